"""A node's tokenizer record (workers/models/tokenizer_record.py) answers what the engine asks exactly
as transformers' tokenizer does: token ids, decoded text (single, batched, streamed), llguidance's
tokenizer source, and (through transformers, on first use) the chat template. Tokenizers: the real
SmolLM2 one (every tiny family's), the real Qwen2.5 one where this machine has it cached, and the
tokenizer classes transformers gives the seven families (Llama: Llama, Mistral, Phi-3, Mixtral,
DeepSeek; Qwen2: Qwen2 / Qwen3 and their MoE; Gemma) built over SmolLM2's vocabulary."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workers.detokenizer import IncrementalDetokenizer, batch_decoder
from workers.models.assets.prepare import default_cache_dir
from workers.models.tokenizer_record import RecordedTokenizer, load_tokenizer, record_of
from workers.structured.grammar import build_tokenizer

TEXTS = ["", "Hello world", "  leading and trailing spaces  ", "tabs\tand\nnew\n\nlines", "ünïcödé — «quotes» 日本語 🙂",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n    return x ** 2  # code",
         "<|endoftext|> special in the middle <|im_end|>", "numbers 1234567890 3.14159", "a" * 300]
SPECIAL_TOKENS = dict(unk_token="<|endoftext|>", bos_token="<|im_start|>", eos_token="<|im_end|>",
                      pad_token="<|im_end|>")
FAMILY_CLASSES = {"llama": ("LlamaTokenizer", {}), "qwen2": ("Qwen2Tokenizer", {}),
                  "gemma": ("GemmaTokenizer", {"mask_token": "<|endoftext|>"})}
TOKENIZERS = ["smollm2", "qwen2.5-coder", *FAMILY_CLASSES]


def _checkpoint(name: str, smollm2_path: Path, out: Path) -> Path:
    """A directory with tokenizer ``name``'s files (and SmolLM2's chat template)."""
    import transformers

    out.mkdir(parents=True)
    if name == "smollm2":
        src = smollm2_path
    elif name == "qwen2.5-coder":
        src = default_cache_dir() / "models" / "Qwen2.5-Coder-0.5B-Instruct"
        if not (src / "tokenizer.json").exists():
            pytest.skip(f"no Qwen2.5-Coder checkpoint prepared in {src.parent}")
    else:
        cls, extra = FAMILY_CLASSES[name]
        model = json.loads((smollm2_path / "tokenizer.json").read_text())["model"]
        tok = getattr(transformers, cls)(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                                         **SPECIAL_TOKENS, **extra)
        tok.save_pretrained(out)
        shutil.copy(smollm2_path / "chat_template.jinja", out / "chat_template.jinja")
        return out
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_recorded_tokenizer_answers_as_transformers_does(name, smollm2_path, tmp_path):
    from transformers import AutoTokenizer

    path = _checkpoint(name, smollm2_path, tmp_path / "ckpt")
    node = tmp_path / "node"
    want = AutoTokenizer.from_pretrained(path)
    first = load_tokenizer(path, node)  # a miss: transformers' own, recorded
    assert not isinstance(first, RecordedTokenizer) and len(list(node.glob("tokenizer-*.json"))) == 1
    got = load_tokenizer(path, node)
    assert isinstance(got, RecordedTokenizer)

    assert (len(got), got.eos_token_id, got.vocab_size) == (len(want), want.eos_token_id, want.vocab_size)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text), text
        assert got.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False), text
    rng = random.Random(0)
    specials = sorted(set(want.all_special_ids))
    windows = [[rng.randrange(len(want)) for _ in range(rng.randrange(1, 12))] + rng.sample(specials, 1)
               for _ in range(300)] + [want.encode(t) for t in TEXTS]
    for ids in windows:
        for skip in (True, False):
            assert got.decode(ids, skip_special_tokens=skip) == want.decode(ids, skip_special_tokens=skip), ids
    assert got.decode(windows[0][0]) == want.decode(windows[0][0])  # one id
    assert batch_decoder(got)(windows) == [want.decode(w, skip_special_tokens=True) for w in windows]

    ids = want.encode(" ".join(TEXTS))  # streamed text, token by token
    a, b = IncrementalDetokenizer(got, ids[:3]), IncrementalDetokenizer(want, ids[:3])
    assert [a.add(t) for t in ids[3:]] == [b.add(t) for t in ids[3:]]

    # llguidance's tokenizer comes from the very string it serializes from transformers' tokenizer
    assert got.serialized_backend == record_of(want)["backend"]  # type: ignore[index]
    if name == "smollm2":  # (a 150k vocabulary takes seconds)
        build_tokenizer(got, len(want), [want.eos_token_id])
    # what the record does not hold is transformers' answer (loaded on first use)
    chat = [{"role": "user", "content": "Hi there"}]
    assert got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_a_tokenizer_that_post_processes_text_is_not_recorded(smollm2_path, tmp_path):
    path = _checkpoint("smollm2", smollm2_path, tmp_path / "ckpt")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    node = tmp_path / "node"
    load_tokenizer(path, node)
    assert not isinstance(load_tokenizer(path, node), RecordedTokenizer)
    assert list(node.glob("tokenizer-*.json")) == []


def test_a_torn_record_loads_through_transformers(smollm2_path, tmp_path):
    path = _checkpoint("smollm2", smollm2_path, tmp_path / "ckpt")
    node = tmp_path / "node"
    load_tokenizer(path, node)
    record = next(node.glob("tokenizer-*.json"))
    record.write_text(record.read_text()[:100])
    tok = load_tokenizer(path, node)
    assert not isinstance(tok, RecordedTokenizer) and tok.encode("Hello") == [19556]
    assert isinstance(load_tokenizer(path, node), RecordedTokenizer)  # rewritten whole


CHILD = r"""
import sys
from pathlib import Path
from workers.models.spec_record import read_spec
from workers.models.tokenizer_record import load_tokenizer
path, node = Path(sys.argv[1]), Path(sys.argv[2])
spec, tok = read_spec(path, node), load_tokenizer(path, node)
print(spec.model_type, tok.encode("Hello world"), "transformers" in sys.modules)
"""


def test_a_later_start_on_the_node_does_not_import_transformers(smollm2_path, tmp_path):
    node = tmp_path / "node"
    runs = [subprocess.run([sys.executable, "-c", CHILD, str(smollm2_path), str(node)], capture_output=True, text=True,
                           check=True, cwd=Path(__file__).resolve().parents[3]).stdout.split("\n")[-2]
            for _ in range(2)]
    assert runs == ["llama [19556, 905] True", "llama [19556, 905] False"]


def test_a_changed_tokenizer_file_is_a_new_record(smollm2_path, tmp_path):
    path = _checkpoint("smollm2", smollm2_path, tmp_path / "ckpt")
    node = tmp_path / "node"
    load_tokenizer(path, node)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|endoftext|>"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(path, node)  # a miss again: transformers' own, with the new EOS
    assert not isinstance(tok, RecordedTokenizer) and tok.eos_token_id == 0
    again = load_tokenizer(path, node)
    assert isinstance(again, RecordedTokenizer) and again.eos_token_id == 0
    assert len(list(node.glob("tokenizer-*.json"))) == 2
