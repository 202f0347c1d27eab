"""Prefill/decode disaggregation on one machine: a prefill worker and a decode worker, each a worker
gRPC service in its own process (no Ray), KV over the gloo staging path (CUDA blocks -> pinned host
buffer -> gloo -> pinned buffer -> CUDA blocks; ``kv_transfer_backend: gloo``). Each prompt (longer
than a KV block) goes to the decode worker with ``remote_prefill`` naming the prefill worker; its
greedy tokens must equal a colocated engine's (in this process, one prompt at a time, like the
requests), and then all prompts at once (concurrent transfers on one pair)."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import torch

from benchmarks.gpu_check import common, models

CUDA_ONLY = False
BUDGET_S = 55.0
NEW = 24


def submit(stub, rid: str, prompt: list[int], remote=None) -> list[int]:
    from protos.duet.worker.v1 import worker_pb2

    req = worker_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt,
                                   sampling=worker_pb2.SamplingParams(max_tokens=NEW, temperature=0, top_p=1,
                                                                      ignore_eos=True))
    if remote is not None:
        req.remote_prefill.CopyFrom(remote)
    tokens: list[int] = []
    for msg in stub.Submit(req, timeout=60):
        tokens.extend(msg.token_ids)
    return tokens


def run(ctx) -> dict:
    from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

    dtype = common.dtype_for(ctx)
    path = common.checkpoint(ctx, "smollm2-135m", dtype)
    # both workers load at once, while this process computes the reference
    with common.WorkerProcess(path, ctx, dtype, "gloo", "prefill", wait=False) as pw, \
            common.WorkerProcess(path, ctx, dtype, "gloo", "decode", wait=False) as dw:
        eng = common.engine(path, ctx, dtype)
        prompts = models.prompts(6, eng.spec.vocab_size, 20, 120, seed=31)
        ref = [common.greedy(eng, [p], NEW, prefix=f"c{i}-")[0] for i, p in enumerate(prompts)]
        del eng
        if ctx.cuda:
            torch.cuda.empty_cache()
        pw.wait_ready()
        dw.wait_ready()
        remote = worker_pb2.RemotePrefill(worker_id=pw.worker_id, endpoint=pw.endpoint, incarnation=pw.incarnation)
        with grpc.insecure_channel(dw.endpoint) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            seq = [submit(stub, f"pd{i}", p, remote) for i, p in enumerate(prompts)]
            with cf.ThreadPoolExecutor(len(prompts)) as pool:
                conc = list(pool.map(lambda ip: submit(stub, f"pc{ip[0]}", ip[1], remote), enumerate(prompts)))
            load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        pw.close_stdin()  # both stop at once (each exit then waits for its own)
        dw.close_stdin()
    eq_seq = sum(a == b for a, b in zip(seq, ref))
    eq_conc = sum(a == b for a, b in zip(conc, ref))
    out = {"backend": "gloo (pinned host staging)" if ctx.cuda else "gloo (CPU)", "dtype": common.dname(dtype),
           "sequential_equal": f"{eq_seq}/{len(prompts)}", "concurrent_equal": f"{eq_conc}/{len(prompts)}",
           "kv_transfers_received": load.kv_transfers_received, "kv_bytes_received": load.kv_bytes_received,
           "kv_transfer_seconds": round(load.kv_transfer_seconds, 4)}
    out["checks"] = {"pd_tokens_equal_colocated": eq_seq == len(prompts),
                     "pd_concurrent_equal_colocated": eq_conc == len(prompts),
                     "kv_went_over_the_pair": load.kv_transfers_received >= 2 * len(prompts)}
    mb = load.kv_bytes_received / 1e6
    out["summary"] = (f"{out['sequential_equal']} sequential, {out['concurrent_equal']} concurrent equal colocated; "
                      f"{load.kv_transfers_received} transfers, {mb:.1f} MB in {load.kv_transfer_seconds:.3f} s")
    return out
