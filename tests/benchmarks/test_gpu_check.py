"""`make gpu-check` (benchmarks/gpu_check/) on CPU: what CI can run of it.

- Nothing it imports needs ray, gguf or accelerate (the bare GPU machine has none of them): every
  section module and everything the sections import lazily are imported with those blocked.
- Its CPU parts pass end to end with tiny model shapes and ray/gguf/accelerate blocked
  (--simulate-bare): engine vs HF, P/D over gloo in two worker processes, a CPU drafter through
  ``drafter_device``, the worker service + router; the CUDA-only sections are skipped with the
  reason; the JSON is written where $OUT says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LAZY_IMPORTS = [
    "benchmarks.gpu_check.harness", "benchmarks.gpu_check.common", "benchmarks.gpu_check.models",
    "benchmarks.gpu_check.kernels", "benchmarks.gpu_check.engine_hf", "benchmarks.gpu_check.graphs",
    "benchmarks.gpu_check.speed", "benchmarks.gpu_check.pd", "benchmarks.gpu_check.spec",
    "benchmarks.gpu_check.grpc_router", "benchmarks.gpu_check.worker_proc", "benchmarks.gpu_check.gang",
    "workers.engine.engine", "workers.server.service", "workers.engine.cuda_graphs", "workers.spec_decode.draft_model",
    "workers.spec_decode.drafter", "workers.spec_decode.drafter_service", "workers.engine.scheduler",
    "router.config", "router.server", "protos.duet.worker.v1.worker_pb2_grpc", "protos.duet.v1.duet_pb2_grpc",
    "kernels",
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_imports_without_ray_gguf_accelerate() -> None:
    code = ("import sys\n"
            "for m in ('ray', 'gguf', 'accelerate'): sys.modules[m] = None\n"
            f"for m in {LAZY_IMPORTS!r}: __import__(m)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_cpu_parts_end_to_end(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--device", "cpu", "--simulate-bare",
           "--total-budget", "1500", "--work", str(tmp_path / "work")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(OUT=str(out_dir)), timeout=1600, cwd=REPO)
    report = json.loads((out_dir / "gpu_check.json").read_text())
    sections = report["sections"]
    detail = {k: (v["status"], v.get("error"), v.get("failed_checks"), v.get("log_tail", "")[-1500:])
              for k, v in sections.items()}
    assert r.returncode == 0 and report["ok"], (r.stdout[-3000:], detail)
    for name in ("kernels", "graphs", "speed", "gang"):
        assert sections[name]["status"] == "skipped" and "needs CUDA" in sections[name]["reason"]
    for name in ("engine_hf", "pd", "spec", "grpc_router"):
        assert sections[name]["status"] == "pass", detail[name]
        assert sections[name]["checks"] and all(sections[name]["checks"].values())
    assert sections["spec"]["drafter_device"] == "cpu"
    assert report["environment"]["blocked_modules"] == "ray,gguf,accelerate,fastapi,uvicorn"
    assert "gpu-check summary" in r.stdout
