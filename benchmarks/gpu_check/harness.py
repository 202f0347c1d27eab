"""The gpu-check driver: sections in subprocesses, each with a time budget; one JSON rewritten after
every section; a readable summary at the end.

A section module (benchmarks/gpu_check/<name>.py) defines:
    CUDA_ONLY: bool      skipped (with the reason) when CUDA is absent
    BUDGET_S: float      its wall-clock budget on a GPU (the run stops at TOTAL_BUDGET_S overall)
    run(ctx) -> dict     figures plus ``checks``: {name: bool}; the section passes when all hold
Status: pass | fail (a check did not hold) | error (it raised: the traceback is kept) | timeout
(killed at its budget, with its process group) | skipped (the reason is kept).
"""

from __future__ import annotations

from typing import Any
import argparse
import importlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

SECTIONS = ("kernels", "engine_hf", "graphs", "speed", "cpu_kernels", "pd", "spec", "grpc_router", "gang", "structured", "decode_profile")
DEFAULT_SECTIONS = SECTIONS[:-1]  # decode_profile is a diagnostic: ask for it with --sections
TOTAL_BUDGET_S = 480.0  # the whole check fits 8 minutes on one GPU
TAIL_CHARS = 4000


@dataclass(frozen=True)
class Ctx:
    """What a section gets: the device it runs on, model size mode, a shared work dir for checkpoints."""

    device: str  # "cuda" or "cpu"
    tiny: bool  # 2-layer model shapes (CI on CPU)
    work: str  # checkpoints built here are reused by later sections
    budget_s: float

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def deadline(self, started: float, frac: float = 0.9) -> float:
        return started + frac * self.budget_s


BLOCK_ENV = "DUET_GPU_CHECK_BLOCK_MODULES"  # set by --simulate-bare; inherited by every section process


def apply_module_blocks() -> None:
    """Make the modules named in $DUET_GPU_CHECK_BLOCK_MODULES unimportable in this process (a bare
    GPU machine has no ray, gguf, accelerate, fastapi or uvicorn: importing one must fail here as it would there)."""
    for name in filter(None, os.environ.get(BLOCK_ENV, "").split(",")):
        sys.modules[name.strip()] = None  # type: ignore[assignment]  # `import name` raises ImportError


def default_out() -> Path:
    out = os.environ.get("OUT")
    if out:
        return Path(out) / "gpu_check.json"
    return Path(__file__).resolve().parents[1] / "results" / "gpu_check.json"


def environment() -> dict:
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("torch", "triton", "transformers", "tokenizers", "grpc", "google.protobuf"):
        try:
            env[mod] = importlib.import_module(mod).__version__
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            env[mod] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import torch

        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
            env["cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001
        env["cuda_available"] = f"unknown ({e})"
    env["ray_importable"] = importlib.util.find_spec("ray") is not None and "ray" not in os.environ.get(BLOCK_ENV, "")
    env["blocked_modules"] = os.environ.get(BLOCK_ENV, "")
    return env


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(path)


def _run_child(name: str, ctx: Ctx, timeout: float) -> dict:
    """Run one section in its own process group; kill the whole group at the budget."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
        result = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", name, "--ctx", json.dumps(asdict(ctx)),
               "--result", str(result)]
        t0 = time.monotonic()
        with open(log, "w") as lf:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        seconds = round(time.monotonic() - t0, 1)
        tail = log.read_text(errors="replace")[-TAIL_CHARS:]
        if result.exists():
            out = json.loads(result.read_text())
        elif rc is None:
            out = {"status": "timeout", "error": f"killed after its budget of {timeout:.0f} s"}
        else:
            out = {"status": "error", "error": f"section process exited with code {rc} without a result"}
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers (worker processes) of a finished section
        except ProcessLookupError:
            pass
        out["seconds"] = seconds
        if out.get("status") not in ("pass", "skipped"):
            out["log_tail"] = tail
        return out


def child(name: str, ctx: Ctx, result: Path) -> int:
    """In the section's process: run it, write its result (also on error)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        mod = importlib.import_module(f"benchmarks.gpu_check.{name}")
        out = mod.run(ctx)
        checks = out.get("checks", {})
        out["status"] = out.get("status") or ("pass" if all(checks.values()) else "fail")
        if out["status"] == "fail":
            out["failed_checks"] = [k for k, v in checks.items() if not v]
    except Exception as e:  # noqa: BLE001 - recorded; the driver goes on with the next section
        out = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result.write_text(json.dumps(out, indent=2, default=str))
    return 0


def _summary_line(name: str, r: dict) -> str:
    figs = r.get("summary", "")
    reason = r.get("reason") or r.get("error") or ", ".join(r.get("failed_checks", []))
    return f"  {name:<10} {r.get('status', '?'):<8} {r.get('seconds', 0):>6.1f} s  {figs}{'  -- ' + reason if reason else ''}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default: $OUT/gpu_check.json when OUT is set, else benchmarks/results/gpu_check.json)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but decode_profile)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda when torch sees a GPU, else cpu (CUDA-only sections are then skipped)")
    ap.add_argument("--tiny", action="store_true", help="2-layer model shapes (quick CPU runs, CI)")
    ap.add_argument("--total-budget", type=float, default=TOTAL_BUDGET_S, help="seconds for all sections together")
    ap.add_argument("--simulate-bare", action="store_true",
                    help="make ray, gguf, accelerate, fastapi and uvicorn unimportable in every section process (what the bare GPU "
                         "machine lacks), to prove the check does not need them")
    ap.add_argument("--work", type=Path, default=None, help="checkpoint dir shared by the sections (default: a temp dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, Ctx(**json.loads(args.ctx)), args.result)

    if args.simulate_bare:
        os.environ[BLOCK_ENV] = "ray,gguf,accelerate,fastapi,uvicorn"
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    env = environment()
    device = args.device
    if device == "auto":
        device = "cuda" if env.get("cuda_available") is True else "cpu"
    if device == "cuda" and env.get("cuda_available") is not True:
        ap.error("--device cuda: torch sees no CUDA device on this machine")
    out_path = args.out or default_out()
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-models-"))
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device, "tiny": args.tiny,
              "environment": env, "sections": {}}
    print(f"gpu-check on {device} ({env.get('gpu', 'no GPU')}); JSON -> {out_path}", flush=True)
    t_start = time.monotonic()
    for name in names:
        mod = importlib.import_module(f"benchmarks.gpu_check.{name}")
        left = args.total_budget - (time.monotonic() - t_start)
        if mod.CUDA_ONLY and device != "cuda":
            r: dict[str, Any] = {"status": "skipped", "reason": "needs CUDA; this machine has none (torch.cuda.is_available() is False)"}
        elif left < 10:
            r = {"status": "skipped", "reason": f"the total budget of {args.total_budget:.0f} s is spent"}
        else:
            budget = min(mod.BUDGET_S * (1.0 if device == "cuda" else 2.0), left)
            print(f"[{name}] running (budget {budget:.0f} s) ...", flush=True)
            r = _run_child(name, Ctx(device, args.tiny, str(work), budget), budget)
        r.setdefault("seconds", 0.0)
        report["sections"][name] = r
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        _write(out_path, report)
        print(_summary_line(name, r), flush=True)
    statuses = [r["status"] for r in report["sections"].values()]
    report["ok"] = all(s in ("pass", "skipped") for s in statuses)
    _write(out_path, report)
    print("\ngpu-check summary:")
    for name, r in report["sections"].items():
        print(_summary_line(name, r))
    print(f"overall: {'OK' if report['ok'] else 'FAILED'} in {report['elapsed_s']:.0f} s; JSON: {out_path}")
    return 0 if report["ok"] else 1
