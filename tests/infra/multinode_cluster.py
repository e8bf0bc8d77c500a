"""A real multi-node Ray cluster on this machine, for the multi-node tests: `MultiNodeCluster`.

Each node is its own ``ray start`` (the head with ``--head``, the others with ``--address``), with
its own temp dir (so its own raylet, object store, session and logs), its own CPUs and custom
resources, exactly as on separate machines except for the IP address they share. Ray 2.5x turns
token authentication on for a new head; the cluster uses it, with a token of its own passed to
every node and driver in the environment (`env`), never written to ``~/.ray``. Ray's health checks
are made faster than its defaults (`HEALTH_CHECK_ENV`), so a node whose raylet dies is declared
dead within `NODE_DEATH_BOUND_S` instead of ~15-30 s.

`add_node` joins one more node to the running cluster, as a new machine would; `kill_raylet`
SIGKILLs one node's raylet process -- a machine lost, not an actor killed through Ray; `stop` ends every process of every node, found by the node's temp dir on its command line
and their children (never ``ray stop``, which would end every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
# Ray's GCS pings every raylet each period and declares it dead after this many misses.
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "4"}
# (period + timeout) x threshold = 6 s for Ray to declare a node dead, plus the controller's next
# reconcile tick and a report timeout: the bound the node-loss test holds the platform to.
NODE_DEATH_BOUND_S = 20.0
START_TIMEOUT_S = 120.0
_NODE_ID_RE = re.compile(r"--node_id=([0-9a-f]{56})")


@dataclass
class RayNode:
    """One ``ray start``ed node: its name in the test, temp dir, and Ray node id once known."""

    name: str
    temp_dir: Path
    num_cpus: int
    resources: Mapping[str, float] = field(default_factory=dict)
    node_id: str | None = None

    @property
    def logical_id(self) -> str:
        """The platform's id for this node (`controller.NODE_ID_PREFIX_CHARS` of the Ray id)."""
        assert self.node_id is not None
        return self.node_id[:16]

    def processes(self) -> list[psutil.Process]:
        """Every live process of this node: those with its temp dir or its node id on the command
        line (the head's Ray client server names only the latter), and their children."""
        markers = [str(self.temp_dir)] + ([self.node_id] if self.node_id else [])
        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(marker in arg for arg in process.info["cmdline"] or () for marker in markers):
                    found[process.pid] = process
                    for child in process.children(recursive=True):
                        found[child.pid] = child
        return list(found.values())

    def raylet(self) -> psutil.Process | None:
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                command = process.cmdline()  # empty for a process just forked or already a zombie
                if command and Path(command[0]).name == "raylet":
                    return process
        return None


class MultiNodeCluster:
    """A head and worker nodes (see the module docstring); use as a context manager."""

    def __init__(self, nodes: list[RayNode], port: int, extra_env: Mapping[str, str] | None = None) -> None:
        self.nodes = {node.name: node for node in nodes}
        self.head = nodes[0]
        self.port = port
        token = secrets.token_hex(16)
        # Drivers (thaw serve, thaw CLI, helper scripts) and nodes all carry the cluster's token;
        # `extra_env` reaches every Ray process (workers inherit their raylet's environment).
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "THAW_"))},
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, **HEALTH_CHECK_ENV, **(extra_env or {})}
        self.address: str | None = None

    def start(self) -> None:
        head = self.head
        self._ray_start(head, "--head", "--port", str(self.port), "--include-dashboard", "false")
        self.address = f"{self._node_ip()}:{self.port}"
        for node in list(self.nodes.values())[1:]:
            self._ray_start(node, "--address", self.address)

    def add_node(self, name: str, num_cpus: int, resources: Mapping[str, float] | None = None) -> RayNode:
        """Starts one more node, joining the running cluster (as a new machine would)."""
        assert name not in self.nodes and self.address is not None
        node = RayNode(name, self.head.temp_dir.parent / name, num_cpus, dict(resources or {}))
        self.nodes[name] = node
        self._ray_start(node, "--address", self.address)
        return node

    def track_node(self, name: str, temp_dir: Path, num_cpus: int, timeout_s: float = START_TIMEOUT_S) -> RayNode:
        """A node something else started (``thaw join``) with `temp_dir`: known once its raylet
        runs, and stopped with the rest."""
        node = RayNode(name, temp_dir, num_cpus)
        self.nodes[name] = node
        deadline = time.monotonic() + timeout_s
        while (raylet := node.raylet()) is None:
            assert time.monotonic() < deadline, f"node {name} has no raylet after {timeout_s:g} s"
            time.sleep(0.2)  # a poll interval, bounded by the deadline
        match = _NODE_ID_RE.search(" ".join(raylet.cmdline()))
        assert match, f"node {name}'s raylet has no --node_id: {raylet.cmdline()}"
        node.node_id = match.group(1)
        return node

    def _ray_start(self, node: RayNode, *args: str) -> None:
        node.temp_dir.mkdir(parents=True, exist_ok=True)
        resources = "{" + ", ".join(f'"{k}": {v}' for k, v in node.resources.items()) + "}"
        result = subprocess.run(
            [RAY, "start", *args, "--num-cpus", str(node.num_cpus), "--num-gpus", "0", "--resources", resources,
             "--temp-dir", str(node.temp_dir), "--disable-usage-stats"],
            capture_output=True, text=True, env=self.env, timeout=START_TIMEOUT_S)
        assert result.returncode == 0, f"ray start for node {node.name} failed:\n{result.stdout}\n{result.stderr}"
        raylet = node.raylet()
        assert raylet is not None, f"node {node.name} has no raylet after ray start"
        match = _NODE_ID_RE.search(" ".join(raylet.cmdline()))
        assert match, f"node {node.name}'s raylet has no --node_id: {raylet.cmdline()}"
        node.node_id = match.group(1)

    def _node_ip(self) -> str:
        """The address the head registered (Ray turns a loopback address into the machine's own)."""
        text = (self.head.temp_dir / "ray_current_cluster").read_text().strip()
        return text.rsplit(":", 1)[0]

    def node_by_logical_id(self, logical_id: str) -> RayNode:
        return next(node for node in self.nodes.values() if node.node_id and node.logical_id == logical_id)

    def kill_raylet(self, name: str) -> None:
        """SIGKILLs node `name`'s raylet (its workers, which lose their raylet, end by themselves)."""
        raylet = self.nodes[name].raylet()
        assert raylet is not None, f"node {name} has no raylet to kill"
        raylet.send_signal(signal.SIGKILL)

    def stop(self) -> None:
        """Ends every process of every node (workers first, the head last) and removes their temp dirs."""
        for node in [*list(self.nodes.values())[1:], self.head]:
            processes = node.processes()
            for process in processes:
                with contextlib.suppress(psutil.Error):
                    process.send_signal(signal.SIGTERM)
            _, alive = psutil.wait_procs(processes, timeout=10)
            for process in alive:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(alive, timeout=10)
        for node in self.nodes.values():
            shutil.rmtree(node.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def multinode_cluster(specs: list[tuple[str, int, Mapping[str, float]]], port: int,
                      extra_env: Mapping[str, str] | None = None) -> Iterator[MultiNodeCluster]:
    """A cluster of `specs` (name, CPUs, custom resources), the first the head, running until the
    block ends. Temp dirs are short, under /tmp: Ray's socket paths must fit in 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="thaw-mn-", dir="/tmp"))
    cluster = MultiNodeCluster([RayNode(name, root / name, cpus, resources) for name, cpus, resources in specs], port,
                               extra_env)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

