"""Give a loaded model its LoRA slots: the AdapterSet a ModelRunner owns when ``lora.enabled``.

Refused at engine start (ConfigError naming both keys): a worker of several ranks, tensor, sequence
or expert parallel size > 1 (the slots are not sharded like the layers they attach to, and a gang's
runner carries no adapter slot per request), and a model with no LoRA-capable projection
(workers/lora/targets.py).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.config import LoraConfig
from workers.errors import ConfigError
from workers.lora.adapter_set import AdapterSet
from workers.lora.stacks import LoraStacks
from workers.parallel.groups import get_group


def check_lora_parallel(lora: LoraConfig, tp_size: int, sp_size: int, ep_size: int = 1) -> None:
    """The parallel layouts LoRA runs with (called by workers/models/support.py and at attach)."""
    if lora.enabled and tp_size > 1:
        raise ConfigError(f"lora.enabled=true with tp_size={tp_size}: LoRA slots are not sharded over tensor-parallel "
                          "ranks; set tp_size to 1 or lora.enabled to false")
    if lora.enabled and sp_size > 1:
        raise ConfigError(f"lora.enabled=true with sp_size={sp_size}: LoRA runs without sequence parallelism; set "
                          "sp_size to 1 or lora.enabled to false")
    if lora.enabled and ep_size > 1:
        raise ConfigError(f"lora.enabled=true with ep_size={ep_size}: LoRA runs in one-rank workers only; set "
                          "ep_size to 1 or lora.enabled to false")


def attach_lora(model: Any, lora: LoraConfig, device: torch.device) -> AdapterSet:
    """Build the slots for ``model`` (a LlamaForCausalLM), attach them, return the AdapterSet."""
    assert lora.enabled
    check_lora_parallel(lora, get_group("tp").world_size, get_group("sp").world_size, get_group("ep").world_size)
    targets = model.lora_targets() if hasattr(model, "lora_targets") else {}
    if not targets:
        raise ConfigError(f"lora.enabled=true: model {type(model).__name__} has no LoRA-capable projections "
                          "(q/k/v/o/gate/up/down of Llama-family layers); set lora.enabled to false")
    stacks = model.lora  # a preloaded model serves several runners in turn (warm-up, then the engine)
    if stacks is None or (stacks.num_slots, stacks.max_rank) != (lora.max_loaded, lora.max_rank):
        assert stacks is None, "a model's LoRA slots are attached once"
        dtype = torch.bfloat16 if model.model.embed_tokens.weight.dtype is torch.bfloat16 else torch.float32
        stacks = LoraStacks(targets, lora.max_loaded, lora.max_rank, device, dtype)
        model.attach_lora(stacks)
    return AdapterSet(stacks, lora)
