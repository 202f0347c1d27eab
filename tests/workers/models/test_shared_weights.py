"""Weights shared per node (workers/models/shared_weights.py): a model mapped from the node's
snapshot equals the plainly loaded one, tensor for tensor and token for token, for each layer kind
(tied and untied heads, float, int8 and q4 linears, MoE experts, MLA); a stale or corrupt
snapshot is replaced, an unusable directory is warned about and the worker keeps its own copy; and
two worker processes of one node hold one copy of the weights (resident memory measured from
/proc/<pid>/smaps_rollup) while producing identical tokens."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.llm import LLM
from workers.models.shared_weights import map_snapshot, model_tensors
from workers.sampling_params import SamplingParams

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 140))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SMALL = dict(kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=64)
CASES = {  # case -> (architecture, checkpoint overrides, quantization)
    "llama-tied": ("llama", {"tie_word_embeddings": True}, "none"),
    "llama-tied-int8": ("llama", {"tie_word_embeddings": True}, "int8"),
    "llama-q4": ("llama", {"tie_word_embeddings": False}, "q4"),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64}, "none"),
    "deepseek_v2-mla": ("deepseek_v2", {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": 32, "n_shared_experts": 1,
                                        "num_key_value_heads": 4, "q_lora_rank": None}, "none"),
}


def _tokens(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("case", CASES)
def test_mapped_model_equals_the_plain_one(case, tiny_checkpoint, tmp_path):
    arch, overrides, quant = CASES[case]
    path = str(tiny_checkpoint(arch, **overrides))
    plain = LLM(path, quantization=quant, **SMALL)
    first = LLM(path, quantization=quant, shared_weights_dir=str(tmp_path / "node"), **SMALL)  # loads, publishes
    second = LLM(path, quantization=quant, shared_weights_dir=str(tmp_path / "node"), **SMALL)  # maps
    snapshots = list((tmp_path / "node").glob("*.safetensors"))
    assert len(snapshots) == 1
    want = model_tensors(plain.engine.runner.model)
    ranges = _mapped_ranges(snapshots[0])
    for llm in (first, second):
        got = model_tensors(llm.engine.runner.model)
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert torch.equal(got[name], t), name
            # a view of the node's file: the publisher dropped its private copy, the second never had one
            assert t.numel() == 0 or any(lo <= got[name].data_ptr() < hi for lo, hi in ranges), name
    assert _tokens(first) == _tokens(second) == _tokens(plain)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path.resolve())):
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def test_a_corrupt_snapshot_is_replaced(tiny_checkpoint, tmp_path, caplog):
    path = str(tiny_checkpoint("llama"))
    node = tmp_path / "node"
    want = _tokens(LLM(path, shared_weights_dir=str(node), **SMALL))
    snap = next(node.glob("*.safetensors"))
    size = snap.stat().st_size
    snap.chmod(0o644)
    snap.write_bytes(snap.read_bytes()[: size // 2])  # truncated
    with caplog.at_level(logging.WARNING, logger="workers.models.shared_weights"):
        again = LLM(path, shared_weights_dir=str(node), **SMALL)
    assert "is unusable" in caplog.text
    assert _tokens(again) == want
    assert snap.stat().st_size == size  # rewritten whole
    assert len(map_snapshot(snap)[0]) == len(model_tensors(again.engine.runner.model)) - _tied(again)


def _tied(llm: LLM) -> int:
    """Names beyond the first of each tied tensor (stored once in a snapshot)."""
    tensors = list(model_tensors(llm.engine.runner.model).values())
    return len(tensors) - len({id(t) for t in tensors})


def test_an_unusable_directory_is_warned_about_and_the_worker_loads_its_own(tiny_checkpoint, tmp_path, caplog):
    path = str(tiny_checkpoint("llama"))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="workers.models.shared_weights"):
        llm = LLM(path, shared_weights_dir=str(blocker / "node"), **SMALL)
    assert "loads its own copy" in caplog.text
    assert _tokens(llm) == _tokens(LLM(path, **SMALL))


CHILD = r"""
import json, sys
from transformers import AutoConfig, AutoTokenizer
from workers.llm import LLM
from workers.sampling_params import SamplingParams
kwargs = json.loads(sys.argv[2])
# every worker loads the same libraries (a node's spec and tokenizer records spare a later worker
# transformers' loaders, workers/models/spec_record.py), so Rss - Pss differs between the pairs by the weights
AutoConfig.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
llm = LLM(sys.argv[1], kv_cache_memory_bytes=8 << 20, block_size=8, **kwargs)
out = llm.generate([[1, 504, 3575, 282, 4649, 314]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
print(json.dumps({"tokens": out[0].token_ids}), flush=True)
sys.stdin.readline()  # measured while both processes are alive
rollup = dict(line.split(":", 1) for line in open("/proc/self/smaps_rollup").read().splitlines()[1:])
print(json.dumps({k: int(v.split()[0]) * 1024 for k, v in rollup.items()}), flush=True)
sys.stdin.readline()
"""


def _two_workers(path: str, kwargs: dict) -> list[dict]:
    """Start two worker processes one after the other, then read both resident-memory rollups."""
    procs, tokens = [], []
    try:
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", CHILD, path, json.dumps(kwargs)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            tokens.append(json.loads(p.stdout.readline())["tokens"])
        rollups = []
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            rollups.append(json.loads(p.stdout.readline()))
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [{"tokens": t, **r} for t, r in zip(tokens, rollups)]


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="resident memory is read from Linux's /proc")
def test_two_workers_of_a_node_share_one_copy(tmp_path, smollm2_path):
    """SmolLM2-shaped widths at 2 layers: a 110 MB snapshot, dominated by the tied embedding."""
    from tests.testkit.tiny_families import save_tiny

    path = str(save_tiny(tmp_path / "ckpt", smollm2_path, "llama", hidden_size=576, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True))
    shared = _two_workers(path, {"shared_weights_dir": str(tmp_path / "node")})
    private = _two_workers(path, {})
    size = next((tmp_path / "node").glob("*.safetensors")).stat().st_size
    assert shared[0]["tokens"] == shared[1]["tokens"] == private[0]["tokens"] == private[1]["tokens"]
    # Rss - Pss is what a process shares with the other one: libraries (torch's, ~150 MB) for both
    # pairs, and for the shared pair also the weights, resident once and charged half to each
    for a, b in zip(shared, private):
        assert (a["Rss"] - a["Pss"]) - (b["Rss"] - b["Pss"]) >= 0.4 * size, (a, b, size)
    assert sum(a["Pss"] for a in shared) < sum(a["Pss"] for a in private) - 0.8 * size, (shared, private, size)
