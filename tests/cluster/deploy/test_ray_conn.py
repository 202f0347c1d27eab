"""RayConnection.reachable: what the shutdown asks before waiting on actors (cluster/deploy/serve.py)."""

from __future__ import annotations

import socket

from cluster.deploy.ray_conn import RayConnection


def test_reachable_follows_whether_the_gcs_port_accepts_connections() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert RayConnection("embedded", f"127.0.0.1:{port}", "", "duet").reachable()
    assert not RayConnection("embedded", f"127.0.0.1:{port}", "", "duet").reachable(timeout_s=0.5)
    assert RayConnection("reused", "", "", "duet").reachable()  # address unknown: assume it is there


def test_after_no_auto_init_a_stray_ray_call_raises_instead_of_starting_a_local_ray() -> None:
    """What keeps a late call on another thread (after ``close``) from starting a fresh local Ray
    (cluster/deploy/ray_conn.py no_auto_init): run in a clean interpreter, where Ray is not started."""
    import subprocess
    import sys

    code = ("import ray\n"
            "from cluster.deploy.ray_conn import no_auto_init\n"
            "no_auto_init()\n"
            "try:\n"
            "    ray.wait([], timeout=0)\n"
            "except Exception as e:\n"
            "    print('raised', type(e).__name__)\n"
            "print('initialized', ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]))
    assert out.returncode == 0, out.stderr
    assert "raised" in out.stdout and "initialized False" in out.stdout, out.stdout + out.stderr
