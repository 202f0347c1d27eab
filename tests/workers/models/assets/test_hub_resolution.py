"""Hub ids resolve through huggingface_hub's standard cache, offline: a cache directory laid out as
huggingface_hub writes it (models--org--name/{blobs,refs,snapshots}) serves the model; a missing
id offline fails with a message naming the id and what to do."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from workers.errors import ModelNotFoundError
from workers.models.assets.resolve import resolve_model
from workers.models.assets.hub import is_hub_id, split_revision

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, repo: str, checkpoint: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Lay ``checkpoint``'s files out as huggingface_hub's cache: blobs by sha256, snapshot links, a ref."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in checkpoint.iterdir():
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy(f, repo_dir / "blobs" / digest)
            (snap / f.name).symlink_to(Path("../../blobs") / digest)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3", head_dim=16)
    cache = _hub_cache(tmp_path / "hub", "acme/tiny-qwen3", ckpt)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return cache, ckpt


def test_hub_id_syntax():
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("acme/x@v1.0")
    assert not is_hub_id("just-a-name") and not is_hub_id("./rel/dir") and not is_hub_id("/abs/dir")
    assert split_revision("acme/x@abc") == ("acme/x", "abc") and split_revision("acme/x") == ("acme/x", None)


def test_resolves_from_the_standard_cache_offline(offline_cache):
    cache, ckpt = offline_cache
    path = resolve_model("acme/tiny-qwen3")
    assert path == cache / "models--acme--tiny-qwen3" / "snapshots" / COMMIT
    assert (path / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    assert resolve_model(f"acme/tiny-qwen3@{COMMIT}") == path  # a pinned revision


def test_engine_serves_a_hub_id(offline_cache):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    _, ckpt = offline_cache
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_id = LLM("acme/tiny-qwen3", kv_cache_memory_bytes=4 << 20).generate([[1, 2, 3]], params)[0].token_ids
    by_dir = LLM(str(ckpt), kv_cache_memory_bytes=4 << 20).generate([[1, 2, 3]], params)[0].token_ids
    assert by_id == by_dir


def test_missing_id_offline_says_what_to_do(offline_cache):
    with pytest.raises(ModelNotFoundError, match=r"'acme/absent'.*not in the local Hugging Face cache.*hf download"):
        resolve_model("acme/absent")
