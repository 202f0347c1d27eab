"""Disaggregated prefill/decode between pools of different parallel shapes, and a speculating
decode pool behind a prefill pool, through `duet serve`'s deployment (controller, Ray actors and
gangs, worker gRPC, KV over torch.distributed pair groups, the router's public API).

These pools need more Ray CPUs than the test session's 2-CPU cluster offers, so each deployment
runs in a process of its own with an embedded Ray (tests/e2e/pd_shapes_driver.py) and reports
what it saw as JSON. Each prefill -> decode pair is driven directly (the decode worker's Submit
naming the prefill worker), so every pairing of shapes is exercised whatever the router would
pick; then the same prompts go through the router. Greedy tokens must equal the single-process
colocated engine's everywhere:
  - SmolLM2: P tp1 -> D tp1, P tp2 -> D tp1, P tp1 -> D tp2, P tp2 -> D tp2, where the tp1 decode
    pool speculates with a draft_model drafter actor and the tp2 decode pool with ngram;
  - tiny Mixtral: P tp1 -> D ep2 and P ep2 -> D tp1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


DRIVER = Path(__file__).with_name("pd_shapes_driver.py")
ROOT = Path(__file__).resolve().parents[2]
KV = 32 << 20
COMMON = """
router: {port: 0, http_port: 0, policy: least_loaded, disagg_min_prompt_tokens: 16}
controller: {port: 0, poll_interval_s: 0.2, start_timeout_s: 600}
"""


def _pool(name: str, role: str, extra: str = "") -> str:
    return (f"  - {{name: {name}, role: {role}, replicas: 1, cpus_per_replica: 1, "
            f"engine: {{kv_cache_memory_bytes: {KV}}}{extra}}}\n")


def _run(tmp_path: Path, name: str, yaml: str, model: Path, pairs: list[list[str]]) -> dict:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(DRIVER), str(config), str(model), json.dumps(pairs)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _check_tokens(result: dict) -> None:
    want = result["reference"]
    for pair, tokens in result["pairs"].items():
        assert tokens == want, f"{pair}: disaggregated tokens differ from the colocated engine's"
    assert result["routed"] == want


def test_smollm2_tp_shapes_and_speculating_decode_pools(tmp_path, smollm2_path):
    yaml = (f"ray: {{num_cpus: 7, namespace: duet_pd_shapes}}\n{COMMON}pools:\n"
            + _pool("prefill1", "prefill") + _pool("prefill2", "prefill", ", tp_size: 2")
            + _pool("decode1", "decode", f", speculative: {{method: draft_model, draft_model: '{smollm2_path}', "
                                         "draft_quantization: int8, adaptive: false}")
            + _pool("decode2", "decode", ", tp_size: 2, speculative: {method: ngram}"))
    pairs = [["prefill1-0", "decode1-0"], ["prefill2-0", "decode1-0"], ["prefill1-0", "decode2-0"],
             ["prefill2-0", "decode2-0"]]
    result = _run(tmp_path, "smollm2", yaml, smollm2_path, pairs)
    _check_tokens(result)
    loads = result["loads"]
    n = len(result["reference"])
    # each prefill worker served two pairs directly (plus whatever the router sent it)
    assert int(loads["prefill1-0"]["kv_transfers_sent"]) >= 2 * n
    assert int(loads["prefill2-0"]["kv_transfers_sent"]) >= 2 * n
    for d in ("decode1-0", "decode2-0"):
        assert int(loads[d]["kv_transfers_received"]) >= 2 * n and int(loads[d].get("kv_transfer_failures", 0)) == 0
    assert loads["decode1-0"]["spec_method"] == "draft_model" and int(loads["decode1-0"]["spec_verifies"]) > 0
    assert int(loads["decode1-0"]["spec_accepted_tokens"]) > 0
    assert loads["decode2-0"]["spec_method"] == "ngram"


def test_mixtral_ep_gang_on_either_side(tmp_path, smollm2_path):
    from testkit.mixtral_tiny import save_tiny_mixtral

    model = save_tiny_mixtral(tmp_path / "mixtral", smollm2_path, seed=2)
    yaml = (f"ray: {{num_cpus: 6, namespace: duet_pd_ep}}\n{COMMON}pools:\n"
            + _pool("prefill1", "prefill") + _pool("prefillep", "prefill", ", ep_size: 2")
            + _pool("decode1", "decode") + _pool("decodeep", "decode", ", ep_size: 2"))
    result = _run(tmp_path, "mixtral", yaml, model, [["prefill1-0", "decodeep-0"], ["prefillep-0", "decode1-0"]])
    _check_tokens(result)
    loads = result["loads"]
    assert int(loads["prefillep-0"]["kv_transfers_sent"]) >= len(result["reference"])
    assert int(loads["decodeep-0"]["kv_transfers_received"]) >= len(result["reference"])
