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
