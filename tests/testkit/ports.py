"""A TCP port for a test server that must be given a number (a setting whose 0 means "off", a
subprocess told its port).

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range, the range every
outgoing connection on the machine also takes its source port from: under a parallel suite a gRPC
client or a Ray daemon can take that port in the moment between the test learning it and its server
binding it ("Address already in use"). So a random free port below that range, above Ray's worker
ports (10002-19999 by default), is picked instead; bind(0) only where that room does not exist.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOW = 20000  # above Ray's default worker ports (min_worker_port 10002 .. max_worker_port 19999)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1, outside the ephemeral range where there is room."""
    high = _ephemeral_low() - 1
    if high - _LOW >= 1000:
        for _ in range(100):
            port = random.randint(_LOW, high)
            if _binds(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
