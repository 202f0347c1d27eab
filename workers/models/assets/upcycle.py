"""Sparse upcycling: turn a dense Llama-architecture checkpoint into a Mixtral one -- a TEST ASSET
for the MoE path, not a quality model.

No MoE weights exist offline, so the MoE code paths (router, dispatch, expert parallelism,
rebalancing) are exercised on a Mixtral built from SmolLM2-135M-Instruct: every layer's MLP is
copied into E experts (default 8, top-2), each copy plus small deterministic noise
(``noise`` x the matrix's own std) so experts differ and routing matters, and a router [E, H] is
initialised with random directions whose scale falls geometrically with the expert index, so some
experts are picked far more often than others (uneven routing, something to rebalance). Attention,
norms and embeddings are copied unchanged. Because the routing weights of a token's top-k experts
sum to 1 and the experts are near-copies of the dense MLP, the result still writes SmolLM2-like
text; with ``noise=0`` it computes exactly the dense model (the test checks this).

Output: a transformers-5 Mixtral checkpoint (fused ``mlp.experts.gate_up_proj`` [E, 2I, H] /
``down_proj`` [E, H, I] tensors, one safetensors shard per layer plus an index, tokenizer files)
in ``<cache>/models/<name>``; ``transformers.AutoModelForCausalLM`` and Duet both load it. Same
arguments, same bytes (seeded); an existing complete copy with the same arguments is reused.
SmolLM2-135M with E = 8 is ~2.5 GB in fp32 and takes a few seconds to build.

    python -m workers.models.assets.upcycle [--experts 8] [--top-k 2] [--seed 0] [--force]

Axes: E experts, H hidden, I MLP width.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from workers.errors import CheckpointError
from workers.models.assets.prepare import default_cache_dir, prepare_smollm2
from workers.models.loader import iter_safetensors

logger = logging.getLogger(__name__)

UPCYCLED_NAME = "SmolLM2-135M-MoE-upcycled"
_MARKER = ".duet-upcycle.json"
_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def upcycle(dense: Path | None = None, out: Path | None = None, num_experts: int = 8, top_k: int = 2,
            noise: float = 0.01, router_gain: float = 4.0, router_decay: float = 0.8, seed: int = 0,
            force: bool = False) -> Path:
    """Build (or reuse) the upcycled checkpoint; returns its directory."""
    dense = dense or prepare_smollm2()
    out = out or default_cache_dir() / "models" / f"{UPCYCLED_NAME}-{num_experts}x-top{top_k}"
    args = {"dense": str(dense), "num_experts": num_experts, "top_k": top_k, "noise": noise,
            "router_gain": router_gain, "router_decay": router_decay, "seed": seed, "version": 1}
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: must be in [1, num_experts={num_experts}]")
    if not force and _reusable(out, args):
        return out
    t0 = time.perf_counter()
    cfg = json.loads((dense / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise CheckpointError(f"{dense}: upcycling needs a dense llama checkpoint, got {cfg.get('model_type')!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_config(cfg, tmp, num_experts, top_k)
        _write_weights(dense, tmp, cfg, num_experts, noise, router_gain, router_decay, seed)
        for f in dense.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                shutil.copy(f, tmp / f.name)
        (tmp / _MARKER).write_text(json.dumps(args, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("upcycled %s into %d experts (top-%d) at %s in %.1f s", dense, num_experts, top_k, out,
                time.perf_counter() - t0)
    return out


def _reusable(out: Path, args: dict) -> bool:
    try:
        return json.loads((out / _MARKER).read_text()) == args
    except (OSError, ValueError):
        return False


def _write_config(dense_cfg: dict, out: Path, num_experts: int, top_k: int) -> None:
    from transformers import MixtralConfig

    fields = {k: dense_cfg[k] for k in _CONFIG_KEYS if k in dense_cfg}
    cfg = MixtralConfig(**fields, num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=None)
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.save_pretrained(out)


def _write_weights(dense: Path, out: Path, cfg: dict, num_experts: int, noise: float, gain: float, decay: float,
                   seed: int) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = dict(iter_safetensors(dense, torch.float32))
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    weight_map: dict[str, str] = {}
    shared = {k: v for k, v in tensors.items() if ".mlp." not in k}
    for i in range(layers):
        p = f"model.layers.{i}"
        gate_up = torch.cat([tensors[f"{p}.mlp.gate_proj.weight"], tensors[f"{p}.mlp.up_proj.weight"]])  # [2I, H]
        down = tensors[f"{p}.mlp.down_proj.weight"]  # [H, I]
        # router: random unit directions, expert e scaled by gain * decay^e -> uneven popularity
        scale = gain * decay ** torch.arange(num_experts, dtype=torch.float32)  # [E]
        router = torch.randn(num_experts, hidden, generator=gen) / hidden**0.5 * scale[:, None]  # [E, H]
        shard = {
            f"{p}.mlp.gate.weight": router,
            f"{p}.mlp.experts.gate_up_proj": _noisy_copies(gate_up, num_experts, noise, gen),  # [E, 2I, H]
            f"{p}.mlp.experts.down_proj": _noisy_copies(down, num_experts, noise, gen),  # [E, H, I]
        }
        name = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        shard.update({k: shared.pop(k) for k in [k for k in shared if k.startswith(f"{p}.")]})
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    name = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    save_file(shared, str(out / name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shared, name))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _noisy_copies(w: torch.Tensor, n: int, noise: float, gen: torch.Generator) -> torch.Tensor:
    """n copies of w [R, C], each + noise * std(w) * N(0, 1): [n, R, C]."""
    out = w.expand(n, *w.shape).clone()
    if noise > 0:
        out.add_(torch.randn(out.shape, generator=gen), alpha=noise * w.std().item())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Build a Mixtral TEST ASSET by sparse upcycling SmolLM2-135M-Instruct (not a quality model)."
    )
    parser.add_argument("--dense", type=Path, default=None, help="dense llama checkpoint (default: the cached SmolLM2)")
    parser.add_argument("--out", type=Path, default=None, help=f"default: <cache>/models/{UPCYCLED_NAME}-<E>x-top<k>")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--noise", type=float, default=0.01,
                        help="per-expert noise, times each matrix's std (default 0.01)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if a copy with these arguments exists")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(upcycle(a.dense, a.out, a.experts, a.top_k, a.noise, seed=a.seed, force=a.force))


if __name__ == "__main__":
    main()
