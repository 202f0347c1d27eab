"""A private root for the node's shared host tier (``cache.host_tier_dir``): tests that run at the same
time (pytest-xdist workers) each get their own directory in /dev/shm, so none joins another's node
tier, and each can check that its tier's directory is gone when its last worker leaves."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workers.kv.tiers.node import PREFIX


@contextmanager
def private_node_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="duet-test-node-", dir="/dev/shm"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def node_dirs(root: Path) -> list[Path]:
    """The node tiers (one per model fingerprint and KV layout) under ``root``."""
    return sorted(root.glob(f"{PREFIX}*"))
