"""A worker process's thread settings (workers/server/threads.py): the environment a pool starts it
with, and ``apply`` inside a fresh process (niceness of every thread, the wait policy checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from workers.config import EngineConfig
from workers.errors import ConfigError
from workers.server.threads import MALLOC_TUNABLES, process_env

_CHILD = r'''
import json, sys, threading
from workers.config import EngineConfig
from workers.server.threads import apply, thread_niceness
started = threading.Event(); stop = threading.Event()
t = threading.Thread(target=lambda: (started.set(), stop.wait())); t.start(); started.wait()  # a thread from before
s = apply(EngineConfig(**json.loads(sys.argv[1])), 1)
later = []
u = threading.Thread(target=lambda: later.append(sorted(thread_niceness()))); u.start(); u.join()  # one from after
stop.set(); t.join()
print(json.dumps({"niceness": s.niceness, "policy": s.omp_wait_policy, "all": sorted(thread_niceness()), "later": later[0]}))
'''


def _run(config: dict, env: dict[str, str]) -> tuple[dict, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",)}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(config)], env={**base, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_process_env_follows_the_config():
    assert process_env(EngineConfig()) == {"OMP_WAIT_POLICY": "PASSIVE", "RAY_worker_niceness": "0",
                                           "GLIBC_TUNABLES": MALLOC_TUNABLES}
    assert process_env(EngineConfig(omp_wait_policy="active", niceness=7, memory_tuning=False)) == {
        "OMP_WAIT_POLICY": "ACTIVE", "RAY_worker_niceness": "7"}
    assert process_env(EngineConfig(omp_wait_policy="runtime", niceness=None, memory_tuning=False)) == {}


def test_malloc_tunables_are_ones_this_glibc_reads():
    """glibc parses GLIBC_TUNABLES at process start and drops a name it does not know without a word,
    so its dynamic loader lists the values a process started with process_env's environment runs with."""
    loader = next((p for p in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-x86-64.so.2") if os.path.exists(p)), None)
    if loader is None:
        pytest.skip("no glibc x86-64 dynamic loader at its usual path (another C library: GLIBC_TUNABLES is glibc's)")
    out = subprocess.run([loader, "--list-tunables"], env={**os.environ, **process_env(EngineConfig())},
                         capture_output=True, text=True, timeout=30, check=True)
    got = {name: value.split()[0] for name, value in (line.split(": ", 1) for line in out.stdout.splitlines()
                                                      if ": " in line)}
    for item in MALLOC_TUNABLES.split(":"):
        name, value = item.split("=")
        assert int(got[name], 0) == int(value), (name, got.get(name))


def test_apply_sets_every_thread_and_checks_the_policy():
    start = os.getpriority(os.PRIO_PROCESS, 0)
    target = min(19, start + 2)  # raising it needs no privilege
    got, err = _run({"niceness": target}, {"OMP_WAIT_POLICY": "PASSIVE"})
    assert got == {"niceness": target, "policy": "PASSIVE", "all": [target], "later": [target]}
    assert "OMP_WAIT_POLICY" not in err
    got, err = _run({"niceness": None, "omp_wait_policy": "active"}, {"OMP_WAIT_POLICY": "PASSIVE"})
    assert got["niceness"] == start and got["policy"] == "PASSIVE"  # it cannot change after start: said so
    assert "OMP_WAIT_POLICY is 'PASSIVE' in this worker process, the config asks for 'ACTIVE'" in err


@pytest.mark.parametrize("kwargs, key", [({"omp_wait_policy": "spin"}, "omp_wait_policy"),
                                         ({"niceness": 20}, "niceness"), ({"niceness": 1.5}, "niceness"),
                                         ({"memory_tuning": "yes"}, "memory_tuning"),
                                         ({"prepack_weights": 1}, "prepack_weights"),
                                         ({"quantized_batches": "fp8"}, "quantized_batches")])
def test_bad_thread_settings_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=f"^{key}="):
        EngineConfig(**kwargs)
