"""Read a PEFT LoRA adapter directory and check it against the served model.

A PEFT adapter directory holds ``adapter_config.json`` (peft_type LORA, r, lora_alpha,
target_modules, use_rslora, ...) and ``adapter_model.safetensors`` with two tensors per targeted
module, named as PEFT saves them::

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]

The update of module m is delta_W = scale * B @ A with scale = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora), so the adapted layer computes y = x W^T + scale * (x A^T) B^T.

Accepted: rank 1..lora.max_rank, any subset of q/k/v/o/gate/up/down_proj in any subset of layers
(layers_to_transform), a target_modules list or regex (the tensors say what is targeted). Refused,
in one line naming the adapter and the module: DoRA (use_dora), modules_to_save, bias other than
'none', rank_pattern / alpha_pattern (per-module ranks or alphas), fan_in_fan_out, a module that
is not one of the seven projections (embed_tokens, lm_head, ...), a layer the model lacks or whose
shape differs (an adapter made for another base model), and ``adapter_model.bin`` (a pickle: it is
never unpickled; convert it with ``save_pretrained(..., safe_serialization=True)``).

Axes: r rank, in / out the module's input / output features.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.lora.errors import AdapterError
from workers.lora.targets import PEFT_MODULES, LoraTargets, peft_module_names

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# base_model.model.<...>.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter name>].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter: ``weights[(layer, peft module)] = (A [r, in], B [out, r])`` in float32."""

    name: str
    source: str
    rank: int  # the largest rank of its modules (PEFT: r)
    alpha: float
    scale: float  # alpha / rank, or alpha / sqrt(rank) with rslora
    target_modules: tuple[str, ...]  # PEFT names, in PEFT_MODULES order
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _fail(name: str, why: str) -> AdapterError:
    return AdapterError(f"adapter {name!r}: {why}")


def _read_config(name: str, path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise _fail(name, f"{cfg_path} not found: not a PEFT adapter directory") from None
    except (OSError, ValueError) as e:
        raise _fail(name, f"{cfg_path} cannot be read ({e})") from None
    if not isinstance(cfg, dict):
        raise _fail(name, f"{cfg_path} is not a JSON object")
    return cfg


def _check_config(name: str, cfg: dict, max_rank: int) -> tuple[int, float, bool]:
    """(r, alpha, rslora) once every refusal of the module docstring passed."""
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise _fail(name, f"peft_type {kind!r} is not served; only LORA adapters are")
    if cfg.get("use_dora"):
        raise _fail(name, "use_dora=true (DoRA) is not supported; serve a plain LoRA adapter")
    to_save = cfg.get("modules_to_save") or []
    if to_save:
        raise _fail(name, f"module {to_save[0]!r} in modules_to_save is not supported (it replaces a base weight); "
                    "train without modules_to_save")
    if str(cfg.get("bias", "none")) != "none":
        raise _fail(name, f"bias={cfg.get('bias')!r} is not supported; only bias='none'")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(key) or {}
        if pattern:
            module = next(iter(pattern))
            raise _fail(name, f"module {module!r} has its own {key.split('_')[0]} ({key}); per-module ranks and "
                        "alphas are not supported")
    if cfg.get("fan_in_fan_out"):
        raise _fail(name, "fan_in_fan_out=true is not supported (Llama-family projections are [out, in])")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(name, f"r={r!r}: the rank must be a positive integer")
    if r > max_rank:
        raise _fail(name, f"rank r={r} exceeds lora.max_rank={max_rank}; raise lora.max_rank or use a smaller rank")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise _fail(name, f"lora_alpha={alpha!r}: must be a positive number")
    return r, float(alpha), bool(cfg.get("use_rslora", False))


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        if (path / PICKLE_FILE).is_file():
            raise _fail(name, f"{path / PICKLE_FILE} is a pickle and is never unpickled; save the adapter with "
                        "save_pretrained(..., safe_serialization=True) to get adapter_model.safetensors")
        raise _fail(name, f"{weights} not found: not a PEFT adapter directory")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(weights))
    except (OSError, SafetensorError) as e:
        raise _fail(name, f"{weights} cannot be read ({e})") from None


def read_adapter(name: str, source: str, targets: LoraTargets, max_rank: int) -> LoraAdapter:
    """The adapter in directory ``source``, checked against the model's ``targets`` (from
    ``LlamaForCausalLM.lora_targets``) and ``max_rank``; AdapterError names what is wrong."""
    if not name:
        raise AdapterError("adapter name is empty; name the adapter")
    path = Path(source).expanduser()
    if not source or not path.is_dir():
        raise _fail(name, f"source {source!r} is not a directory on this worker (workers load adapters from local "
                    "directories; the router resolves Hub ids where a hub is reachable)")
    r, alpha, rslora = _check_config(name, _read_config(name, path), max_rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(name, path).items():
        m = _KEY.match(key)
        if m is None:
            module = re.split(r"\.(?:lora_|base_layer|modules_to_save|weight|bias)", key.removeprefix("base_model.model."))[0]
            raise _fail(name, f"module {module!r} (tensor {key}) is not a supported LoRA target; supported: "
                        f"{peft_module_names()} of the decoder layers")
        layer, _, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in PEFT_MODULES:
            raise _fail(name, f"module 'layers.{layer}.{m.group(2)}.{module}' is not a supported LoRA target; "
                        f"supported: {peft_module_names()}")
        pairs.setdefault((layer, module), {})[ab] = tensor
    if not pairs:
        raise _fail(name, f"{path / WEIGHTS_FILE} holds no LoRA tensors")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"module 'layers.{layer}.{module}'"
        if set(ab) != {"A", "B"}:
            raise _fail(name, f"{where} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"].to(torch.float32), ab["B"].to(torch.float32)
        projection, part = PEFT_MODULES[module]
        shape = targets.get(layer, {}).get(projection)
        if shape is None:
            raise _fail(name, f"{where}: the served model has no LoRA-capable {module} in layer {layer} (made for "
                        "another base model?)")
        rows = shape.part(part)[1]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape.in_features or b.shape[0] != rows \
                or a.shape[0] != b.shape[1]:
            raise _fail(name, f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the served "
                        f"model's [{rows}, {shape.in_features}] projection (made for another base model?)")
        if a.shape[0] > max_rank:
            raise _fail(name, f"{where}: rank {a.shape[0]} exceeds lora.max_rank={max_rank}")
        rank = max(rank, a.shape[0])
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    modules = tuple(m for m in PEFT_MODULES if any(k[1] == m for k in weights))
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return LoraAdapter(name, source, r, alpha, scale, modules, weights)
