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


@pytest.mark.parametrize("batched", ["backend", "per-window"])
def test_add_batch_equals_add_one_by_one(tokenizer, batched):
    """Several requests, each one token per round, through ``add_batch`` (the engine's step path)
    give exactly the deltas and stop results of ``add`` per request: multi-byte characters, stop
    strings held back and cut, with the tokenizer's batched decode and with the per-window one."""
    from workers.detokenizer import add_batch, batch_decoder

    decode = batch_decoder(tokenizer) if batched == "backend" else (
        lambda windows: [tokenizer.decode(w, skip_special_tokens=True) for w in windows])
    if batched == "backend":  # SmolLM2's fast tokenizer has the one-call path
        assert getattr(tokenizer, "backend_tokenizer", None) is not None and not tokenizer.clean_up_tokenization_spaces
    streams = [tokenizer.encode(t) for t in TEXTS + ["The answer is 42. END of story", "café END 🚀"]]
    stops = [(), ("日本",), (), ("END",), ("END", "🚀")]
    prompt = tokenizer.encode("Prompt:")
    one = [IncrementalDetokenizer(tokenizer, prompt, stop) for stop in stops]
    many = [IncrementalDetokenizer(tokenizer, prompt, stop) for stop in stops]
    live = list(range(len(streams)))
    for step in range(max(map(len, streams))):
        live = [i for i in live if step < len(streams[i])]
        want = [one[i].add(streams[i][step]) for i in live]
        assert add_batch([many[i] for i in live], [streams[i][step] for i in live], decode) == want
        live = [i for i, (_, stopped) in zip(live, want) if not stopped]
    assert [d.flush() for d in many] == [d.flush() for d in one]
    assert [d.state() for d in many] == [d.state() for d in one]
