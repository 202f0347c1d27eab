"""Incremental detokenization: equals a full decode (multi-byte UTF-8 included); stop strings are
cut and never leak into a delta."""

from __future__ import annotations

import pytest

from workers.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is plain ASCII.",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🚀🔥 and more 👩‍👩‍👧.",
    "  leading spaces\nand\ttabs\n\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [d.add(t)[0] for t in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) + d.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_is_cut_and_held_back(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    d = IncrementalDetokenizer(tokenizer, [], stop=("END",))
    emitted = ""
    stopped = False
    for t in ids:
        delta, stopped = d.add(t)
        emitted += delta
        assert "E" not in emitted  # no piece of the stop string is ever streamed
        if stopped:
            break
    assert stopped and emitted + d.flush() == "The answer is 42. "


def test_partial_stop_prefix_released_when_ruled_out(tokenizer):
    ids = tokenizer.encode("ENDLESS ENDING")
    d = IncrementalDetokenizer(tokenizer, [], stop=("END.",))
    text = "".join(d.add(t)[0] for t in ids) + d.flush()
    assert text == "ENDLESS ENDING"
