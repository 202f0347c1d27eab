"""Gangs on CUDA: a tensor-parallel (TP=2, SmolLM2-135M shape) and an expert-parallel (EP=2, tiny
Mixtral) gang whose ranks run their shards on the GPU, fp32, greedy tokens equal to one rank on
the same GPU. Each rank is a process (workers/parallel/launch.py), the leader's engine runs over
the GangRunner and the followers follow, exactly as a serving gang's ranks do.

With two or more GPUs each rank gets its own GPU and the gang's world is ``cpu:gloo,cuda:nccl``
(workers/parallel/groups.py): the forward's collectives run over NCCL. With one GPU, NCCL refuses
two ranks on one device, so both ranks share GPU 0 and the CUDA collectives go over gloo
(``cpu:gloo,cuda:gloo``): everything but NCCL itself runs (CUDA shards, the control channel's host
staging, the collectives on GPU tensors), and the JSON says NCCL was not exercised.
"""

from __future__ import annotations

from typing import Any
import torch

from benchmarks.gpu_check import common, models

CUDA_ONLY = True
BUDGET_S = 70.0
NEW = 16


def _config(path: str, device: str):
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(model=path, dtype="float32", device=device, max_model_len=512,
                        cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
                        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16))


def gang_rank(rank: int, path: str, devices: list[str], prompts: list[list[int]]) -> dict | None:
    """One rank: load this rank's shard on its device; the leader generates, the others follow."""
    from workers.build import build_engine
    from workers.engine.model_runner import ModelRunner
    from workers.engine.gang_runner import GangRunner, follow
    from workers.parallel.groups import get_group

    common.strict_fp32()
    cfg = _config(path, devices[rank])
    runner = ModelRunner.from_config(cfg)
    on = str(runner.kv_cache.device)
    if rank != 0:
        follow(runner, get_group("gang"))
        return None
    gang = GangRunner(runner, get_group("gang"))
    try:
        tokens = common.greedy(build_engine(cfg, runner=gang), prompts, NEW)
    finally:
        gang.stop()
    import torch.distributed as dist

    return {"tokens": tokens, "kv_device": on, "backend": str(dist.get_backend())}


def _one(shape: str, axis: str, ctx) -> dict:
    from workers.build import build_engine
    from workers.parallel.groups import CUDA_BACKEND, ParallelConfig
    from workers.parallel.launch import spawn_gang

    path = common.checkpoint(ctx, shape, torch.float32)
    ref_eng = build_engine(_config(str(path), ctx.device))
    prompts = models.prompts(4, ref_eng.spec.vocab_size, 9, 60, seed=11)
    ref = common.greedy(ref_eng, prompts, NEW)
    del ref_eng
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    if not ctx.cuda:  # the same code on CPU ranks over gloo (a dry run of this section)
        devices, backend = ["cpu", "cpu"], None
    else:
        torch.cuda.empty_cache()
        devices = ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cuda:0"]
        backend = CUDA_BACKEND if gpus >= 2 else "cpu:gloo,cuda:gloo"
    sizes: dict[str, Any] = {f"{axis}_size": 2}
    config = ParallelConfig(**sizes)
    leader = spawn_gang(gang_rank, config, args=(str(path), devices, prompts), timeout=ctx.budget_s * 0.4,
                        devices=devices, backend=backend)[0]
    equal = sum(a == b for a, b in zip(leader["tokens"], ref))
    return {"shape": shape, f"{axis}_size": 2, "devices": devices, "backend": leader["backend"],
            "kv_device": leader["kv_device"], "equal_one_rank": f"{equal}/{len(prompts)}", "ok": equal == len(prompts)}


def run(ctx) -> dict:
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    out: dict = {"gpus": gpus, "nccl_exercised": gpus >= 2}
    if ctx.cuda and gpus < 2:
        out["nccl_note"] = ("one GPU: NCCL refuses two ranks on one device, so the CUDA collectives ran over gloo; "
                            "NCCL gang collectives need a 2-GPU machine")
    out["tp"] = _one("smollm2-135m", "tp", ctx)
    out["ep"] = _one("mixtral-tiny", "ep", ctx)
    out["checks"] = {"tp2_on_cuda_equals_one_rank": out["tp"]["ok"], "ep2_on_cuda_equals_one_rank": out["ep"]["ok"]}
    out["summary"] = (f"TP=2 {out['tp']['equal_one_rank']}, EP=2 {out['ep']['equal_one_rank']} equal one rank "
                      f"({out['tp']['backend']}{'' if gpus >= 2 or not ctx.cuda else ', NCCL not exercised: one GPU'})")
    return out
