"""A node's spec record (workers/models/spec_record.py) gives back exactly the ModelSpec that
transformers' config read gives, for every supported family and each tiny case's special options."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.testkit.tiny_families import CASES, TINY
from workers.models.config import ModelSpec
from workers.models.registry import MODEL_REGISTRY
from workers.models.spec_record import read_spec, spec_key

FAMILY_CASES = {**{t: (t, {}) for t in MODEL_REGISTRY}, **CASES}


def _write_config(out: Path, arch: str, overrides: dict) -> Path:
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.for_model(arch, **{**TINY, **overrides})
    cfg.save_pretrained(out)
    GenerationConfig(eos_token_id=[2, 7]).save_pretrained(out)
    return out


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_recorded_spec_is_transformers_spec(case, tmp_path, monkeypatch):
    arch, overrides = FAMILY_CASES[case]
    path = _write_config(tmp_path / "ckpt", arch, overrides)
    node = tmp_path / "node"
    want = ModelSpec.from_pretrained(path)
    assert read_spec(path, node) == want  # a miss: read through transformers, recorded
    assert list(node.glob("spec-*.json")) == [node / f"spec-{spec_key(path)}.json"]

    def no_transformers(p):
        raise AssertionError("read through transformers despite the record")

    monkeypatch.setattr(ModelSpec, "from_pretrained", staticmethod(no_transformers))
    got = read_spec(path, node)  # a hit
    assert got == want
    assert all(type(getattr(got, f)) is type(getattr(want, f)) for f in want.__dataclass_fields__)


def test_a_changed_config_is_a_new_record(tmp_path):
    path = _write_config(tmp_path / "ckpt", "llama", {})
    node = tmp_path / "node"
    first = read_spec(path, node)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (path / "config.json").write_text(json.dumps(cfg))
    second = read_spec(path, node)
    assert second.rms_norm_eps == 1e-3 and first.rms_norm_eps != 1e-3
    assert len(list(node.glob("spec-*.json"))) == 2


def test_a_torn_record_is_read_again_and_rewritten(tmp_path, caplog):
    path = _write_config(tmp_path / "ckpt", "qwen2", {})
    node = tmp_path / "node"
    want = read_spec(path, node)
    record = node / f"spec-{spec_key(path)}.json"
    record.write_text(record.read_text()[:40])
    with caplog.at_level(logging.WARNING, logger="workers.models.spec_record"):
        assert read_spec(path, node) == want
    assert "unreadable" in caplog.text
    assert json.loads(record.read_text())["model_type"] == "qwen2"


def test_without_a_directory_nothing_is_recorded(tmp_path):
    path = _write_config(tmp_path / "ckpt", "llama", {})
    assert read_spec(path, None) == ModelSpec.from_pretrained(path)
    assert list(tmp_path.rglob("spec-*.json")) == []


def test_an_unwritable_directory_is_warned_about_and_the_spec_still_read(tmp_path, caplog):
    path = _write_config(tmp_path / "ckpt", "llama", {})
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="workers.models.spec_record"):
        assert read_spec(path, blocker / "node") == ModelSpec.from_pretrained(path)
    assert "cannot write the record" in caplog.text
