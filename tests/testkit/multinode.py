"""A real multi-node Ray cluster on this host, for the tests (``ray.cluster_utils.Cluster``).

Terms:
    head        the node this process's driver joins (the router, the controller and the
                membership service run in the driver). It offers no CPUs, so no worker lands there
                and removing any *worker node* never takes the driver down.
    worker node a node with its own raylet, object store and worker processes, started with a
                small logical CPU count and custom resources, like one pod of a KubeRay worker group
                (the Helm chart gives a pool's group ``duet_pool_<name>: 1000``). Each node also
                offers ``duet_node_<name>: 1``, so a test can tell the nodes apart by name.
    removal     ``remove(name)`` kills every process of the node at once (raylet, object store,
                the actors on it), as a lost machine; ``restore()`` starts a fresh node with the
                same name and resources (a replacement pod).

The cluster runs under its own temp dir (short: unix socket paths are limited to 107 bytes) with
ports chosen by the OS, so it neither collides with another Ray on the host nor leaves session
directories behind: ``shutdown()`` stops every process it started, checks none is left, deletes
the temp dir and puts back the address ``ray.init(address="auto")`` finds.

Example::

    cluster = LocalCluster()
    cluster.add("a", num_cpus=2, resources={"duet_pool_default": 1000})
    cluster.add("b", num_cpus=2, resources={"duet_pool_default": 1000})
    ray.init(address=cluster.address)       # or duet serve with ray.address=cluster.address
    cluster.remove("a"); ...; cluster.restore()
    ray.shutdown(); cluster.shutdown()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from testkit.ports import free_port

NODE_RESOURCE = "duet_node_{}"  # offered once by each worker node: its name as Ray sees it
# No idle worker processes started ahead of need (each costs a Python process on a 2-core host);
# a killed node is declared dead after ~1.5 s of failed health checks instead of Ray's ~15-30 s
# default (what a production cluster detects slower; benchmarks/README.md says which was used).
SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                 "health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                 "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


@dataclass
class _Node:
    name: str
    num_cpus: int
    resources: dict[str, float]
    handle: Any = None  # ray._private.node.Node while running
    node_id: str = ""  # hex; a restored node gets a new one


@dataclass
class LocalCluster:
    """A head without CPUs plus named worker nodes (module docstring)."""

    object_store_mb: int = 80
    nodes: dict[str, _Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ray._common.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        # Cluster() records its address where `ray.init(address="auto")` looks: put back what was there
        self._address_file = Path(get_ray_address_file(None))
        self._previous_address = self._address_file.read_text() if self._address_file.exists() else None
        self.temp_dir = tempfile.mkdtemp(prefix="dn", dir="/tmp")
        self._cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=dict(
            num_cpus=0, include_dashboard=False, temp_dir=self.temp_dir, gcs_server_port=free_port(),
            dashboard_agent_listen_port=free_port(), object_store_memory=self.object_store_mb << 20,
            _system_config=SYSTEM_CONFIG))

    @property
    def address(self) -> str:
        """The GCS address (host:port): what ``ray.address`` / ``duet serve --ray-address`` take."""
        return self._cluster.address

    def add(self, name: str, num_cpus: int, resources: dict[str, float] | None = None) -> str:
        """Start worker node ``name``; returns its node id (hex)."""
        assert name not in self.nodes or self.nodes[name].handle is None, f"node {name} is running"
        node = self.nodes.get(name) or _Node(name, num_cpus, {**(resources or {}), NODE_RESOURCE.format(name): 1})
        node.handle = self._cluster.add_node(num_cpus=node.num_cpus, resources=node.resources,
                                             object_store_memory=self.object_store_mb << 20)
        node.node_id = node.handle.node_id
        self.nodes[name] = node
        self._wait_alive(node.node_id, True)
        return node.node_id

    def remove(self, name: str) -> None:
        """Kill node ``name`` (every process on it at once, no grace, as a lost machine) and wait
        until the GCS has it dead. Ray's own ``remove_node`` kills the raylet and its services; the
        worker processes (the actors) would notice only a moment later and keep serving meanwhile,
        so they are killed first, together."""
        from ray._private import ray_constants

        node = self.nodes[name]
        assert node.handle is not None, f"node {name} is not running"
        raylet = node.handle.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        for pid in [raylet, *_descendants(raylet)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._cluster.remove_node(node.handle, allow_graceful=False)
        node.handle = None
        self._wait_alive(node.node_id, False)

    def restore(self) -> list[str]:
        """Start every removed node again (same name and resources, a new node id); their names."""
        back = [n.name for n in self.nodes.values() if n.handle is None]
        for name in back:
            self.add(name, self.nodes[name].num_cpus)
        return back

    def name_of(self, node_id: str) -> str | None:
        """The worker node with this id (None: the head, or a node that is gone)."""
        return next((n.name for n in self.nodes.values() if n.node_id == node_id and n.handle is not None), None)

    def alive(self) -> list[str]:
        return sorted(n.name for n in self.nodes.values() if n.handle is not None)

    def shutdown(self) -> None:
        """Stop every node (workers, then the head), check no process is left, delete the temp dir."""
        nodes = self._cluster.list_all_nodes()
        self._cluster.shutdown()
        left = [n for n in nodes if n.any_processes_alive()]
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self._previous_address is None:
            self._address_file.unlink(missing_ok=True)
        else:
            self._address_file.write_text(self._previous_address)
        assert not left, f"Ray processes left behind by {len(left)} nodes"

    def _wait_alive(self, node_id: str, alive: bool, timeout: float = 60.0) -> None:
        import ray

        deadline = time.monotonic() + timeout
        while True:
            if ray.is_initialized():
                state = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
            else:
                state = {nid: True for nid in self._cluster.global_state._live_node_ids()}
            if state.get(node_id, False) == alive:
                return
            assert time.monotonic() < deadline, f"node {node_id[:8]} not {'alive' if alive else 'dead'} after {timeout} s"
            time.sleep(0.1)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc: children first listed by their parent)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out
