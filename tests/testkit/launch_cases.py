"""Rank functions for tests/workers/parallel/test_launch.py (module-level: ranks import them)."""

from __future__ import annotations

import os
import sys


def where_rank(rank: int, var: str) -> dict:
    """What a rank sees of its start: its parent process, what was imported before it ran, and one
    environment variable."""
    return {"rank": rank, "pid": os.getpid(), "parent": os.getppid(), "transformers": "transformers" in sys.modules,
            "env": os.environ.get(var)}
