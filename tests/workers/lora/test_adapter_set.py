"""AdapterSet and the PEFT reader: LRU over unpinned idle adapters, pins, in-use counts, slot reuse,
and the one-line refusals (each names the adapter and, where one is at fault, the module)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from testkit.lora_cases import save_adapter
from workers.config import LoraConfig
from workers.errors import ConfigError
from workers.lora.adapter_set import AdapterSet
from workers.lora.errors import AdapterCapacityError, AdapterError, AdapterInUse, AdapterNotLoaded
from workers.lora.stacks import LoraStacks
from workers.models.loader import load_model


@pytest.fixture(scope="module")
def targets(tiny_llama: Path):
    model, _ = load_model(tiny_llama, torch.float32)
    return model.lora_targets()


def _set(targets, max_loaded: int = 2, max_rank: int = 16) -> AdapterSet:
    cfg = LoraConfig(enabled=True, max_loaded=max_loaded, max_rank=max_rank)
    return AdapterSet(LoraStacks(targets, max_loaded, max_rank, "cpu"), cfg)


def test_lru_evicts_the_oldest_idle_unpinned(targets, tiny_adapters) -> None:
    s = _set(targets)
    s.load("a", str(tiny_adapters["all8"]))
    s.load("b", str(tiny_adapters["qv4"]))
    s.acquire("a")  # a is in use (and now the most recent)
    s.load("c", str(tiny_adapters["mlp16"]))  # evicts b
    assert s.names() == ["a", "c"] and s.evictions == 1
    s.load("a", "")  # already loaded: refreshes recency only
    s.load("b", str(tiny_adapters["qv4"]))  # evicts c (a is in use)
    assert sorted(s.names()) == ["a", "b"]
    s.release("a")
    assert s.in_use("a") == 0


def test_pinned_and_in_use_adapters_fill_the_set(targets, tiny_adapters) -> None:
    s = _set(targets)
    s.load("a", str(tiny_adapters["all8"]), pin=True)
    s.load("b", str(tiny_adapters["qv4"]))
    s.acquire("b")
    with pytest.raises(AdapterCapacityError, match=r"adapter 'c': all 2 adapter slots \(lora.max_loaded\)"):
        s.load("c", str(tiny_adapters["mlp16"]))
    with pytest.raises(AdapterInUse, match="adapter 'b' has 1 running request"):
        s.unload("b")
    s.release("b")
    s.unload("b")
    s.unload("a")  # pinned: unload still removes it
    with pytest.raises(AdapterNotLoaded, match="adapter 'a' is not loaded"):
        s.unload("a")
    with pytest.raises(AdapterNotLoaded):
        s.acquire("a")


def test_slot_is_cleared_and_reused(targets, tiny_adapters) -> None:
    s = _set(targets, max_loaded=1)
    info = s.load("a", str(tiny_adapters["all8"]))
    assert info.rank == 8 and info.bytes > 0 and info.load_seconds > 0
    assert info.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a = s.stacks._a[(0, "q_proj")]
    assert a[0].abs().sum() > 0
    s.unload("a")
    assert a[0].abs().sum() == 0 and s.stacks.scales[0] == 0
    info = s.load("b", str(tiny_adapters["qv4"]))
    assert info.target_modules == ("q_proj", "v_proj") and info.rank == 4
    assert s.stacks._a[(0, "k_proj")][0].abs().sum() == 0  # k: not targeted by b, zero in its slot
    assert s.stacks._a[(0, "q_proj")][0, 4:].abs().sum() == 0  # rank 4 of 16: zero-padded
    fresh = _set(targets)
    fresh.load("b", str(tiny_adapters["qv4"]))
    assert set(fresh.stacks._a) == {(i, m) for i in (0, 1) for m in ("q_proj", "v_proj")}  # buffers: targeted only


def test_same_name_other_source_is_refused(targets, tiny_adapters) -> None:
    s = _set(targets)
    s.load("a", str(tiny_adapters["all8"]))
    with pytest.raises(AdapterError, match="adapter 'a' is loaded from .* unload it"):
        s.load("a", str(tiny_adapters["qv4"]))


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_refusals_name_the_adapter_and_module(targets, tiny_llama, tiny_adapters, tmp_path) -> None:
    s = _set(targets, max_rank=8)
    src = tiny_adapters["all8"]
    cases = [
        (str(tmp_path / "missing"), r"adapter 'x': source .* is not a directory"),
        (str(_copy(src, tmp_path / "dora", use_dora=True)), r"adapter 'x': use_dora=true \(DoRA\) is not supported"),
        (str(_copy(src, tmp_path / "save", modules_to_save=["lm_head"])),
         r"adapter 'x': module 'lm_head' in modules_to_save is not supported"),
        (str(_copy(src, tmp_path / "rank", r=32)), r"adapter 'x': rank r=32 exceeds lora.max_rank=8"),
        (str(_copy(src, tmp_path / "pattern", rank_pattern={"q_proj": 4})),
         r"adapter 'x': module 'q_proj' has its own rank"),
        (str(tiny_adapters["mlp16"]), r"adapter 'x': rank r=16 exceeds lora.max_rank=8; raise lora.max_rank"),
    ]
    embed = save_adapter(tiny_llama, tmp_path / "embed", seed=9, r=4, targets=["q_proj", "embed_tokens"])
    cases.append((str(embed), r"adapter 'x': module 'model.embed_tokens' \(tensor .*\) is not a supported LoRA target"))
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    shutil.copy(src / "adapter_config.json", pickle)
    (pickle / "adapter_model.bin").write_bytes(b"not read")
    cases.append((str(pickle), r"adapter 'x': .*adapter_model.bin is a pickle and is never unpickled"))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((str(empty), r"adapter 'x': .*adapter_config.json not found: not a PEFT adapter directory"))
    for source, message in cases:
        with pytest.raises(AdapterError, match=message):
            s.load("x", source)
    assert s.names() == []  # nothing half-loaded


def test_adapter_for_another_base_model_is_refused(targets, tiny_adapters, tmp_path, smollm2_path) -> None:
    other = save_adapter(smollm2_path, tmp_path / "smol", seed=1, r=4, targets=["o_proj"])
    with pytest.raises(AdapterError, match=r"adapter 'smol': module 'layers.0.o_proj': lora_A \(4, 576\) / lora_B "
                                           r"\(576, 4\) do not fit the served model's \[64, 64\] projection"):
        _set(targets).load("smol", str(other))


def test_config_edge() -> None:
    with pytest.raises(ConfigError, match=r"lora.max_rank=0: must be an integer in 1..256"):
        LoraConfig(max_rank=0)
    from workers.config import EngineConfig, ParallelConfig
    from workers.lora.attach import check_lora_parallel

    with pytest.raises(ConfigError, match=r"lora.enabled=true with cuda_graphs=true"):
        EngineConfig(device="cuda", cuda_graphs=True, lora=LoraConfig(enabled=True))
    with pytest.raises(ConfigError, match=r"lora.enabled=true with tp_size=2: .* set tp_size to 1 or lora.enabled"):
        check_lora_parallel(LoraConfig(enabled=True), ParallelConfig(tp_size=2).tp_size, 1)
    with pytest.raises(ConfigError, match=r"lora.enabled=true with ep_size=2: .* set ep_size to 1"):
        check_lora_parallel(LoraConfig(enabled=True), 1, 1, 2)
    check_lora_parallel(LoraConfig(enabled=False), 4, 2, 2)  # off: any layout
    assert EngineConfig(lora={"enabled": True, "max_loaded": 3}).lora == LoraConfig(True, 3, 16)


def test_preflight_refuses_lora_in_a_gang(tiny_llama) -> None:
    """The config edge (workers/models/support.py, run by duet serve's preflight) names both keys."""
    from workers.config import EngineConfig, ParallelConfig
    from workers.models.support import check_support

    lora = EngineConfig(model=str(tiny_llama), lora=LoraConfig(enabled=True))
    with pytest.raises(ConfigError, match=r"lora.enabled=true with tp_size=2"):
        check_support(tiny_llama, lora, ParallelConfig(tp_size=2))
    assert check_support(tiny_llama, lora, ParallelConfig()).num_layers == 2
