"""``thaw join``: this machine becomes a node of a running platform, until Ctrl-C (or SIGTERM).

A platform's nodes are its Ray cluster's nodes: the controller adopts every live Ray node it
lists (a node store, its SSD and DRAM tiers, worker slots) within a reconcile tick, and drops
one that leaves. So joining is ``ray start --address HEAD --block`` with this machine's
resources, and that is what this runs, in the foreground, with the cluster's token auth as Ray
reads it from the environment (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``). ``--ssd-dir``,
``--ssd-capacity-gb``, ``--dram-capacity-gb`` and ``--worker-memory-gb`` give this node its own
store settings and worker memory budget instead of the platform's (`storage.node_settings`:
carried to the node's store in its Ray processes' environment, and reported by it to the
controller). What it adds is the way out:
on Ctrl-C or SIGTERM it first drains the node through the platform's admin API (``thaw drain``:
nothing new is placed there, its instances' requests are live-migrated to instances elsewhere),
waits until no instance is left on it (at most ``--drain-timeout-s``), and only then stops the
node, so leaving loses no request. Without an admin key (``--admin-key``, ``$THAW_ADMIN_KEY``)
it leaves undrained and says so: the requests then resume elsewhere as for a lost node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from infra.cli_errors import UsageError

_NODE_ID_RE = re.compile(r"--node_id=([0-9a-f]{56})")
_RESOURCE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-/]{0,99}")


def _ray_start_argv(args: argparse.Namespace) -> list[str]:
    argv = [str(Path(sys.executable).parent / "ray"), "start", "--address", args.address, "--block",
            "--disable-usage-stats"]
    if args.num_cpus is not None:
        if args.num_cpus < 0:
            raise UsageError(f"--num-cpus must be 0 or more, got {args.num_cpus}")
        argv += ["--num-cpus", str(args.num_cpus)]
    if args.num_gpus is not None:
        if args.num_gpus < 0:
            raise UsageError(f"--num-gpus must be 0 or more, got {args.num_gpus}")
        argv += ["--num-gpus", str(args.num_gpus)]
    if args.resource:
        resources = {}
        for item in args.resource:
            name, _, amount = item.partition("=")
            try:
                value = float(amount) if amount else 1.0
            except ValueError:
                value = -1.0
            if not _RESOURCE_RE.fullmatch(name) or not value > 0:
                raise UsageError(f"--resource must be NAME or NAME=AMOUNT (AMOUNT > 0), got {item!r}")
            resources[name] = value
        argv += ["--resources", json.dumps(resources)]
    if args.temp_dir is not None:
        argv += ["--temp-dir", str(Path(args.temp_dir).expanduser().absolute())]
    return argv


def _node_id(process: subprocess.Popen, timeout_s: float) -> str | None:
    """The Ray node id of the raylet `process` (``ray start --block``) started, once it runs."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            for child in psutil.Process(process.pid).children(recursive=True):
                match = _NODE_ID_RE.search(" ".join(child.cmdline()))
                if match:
                    return match.group(1)
        except psutil.Error:
            pass
        time.sleep(0.2)  # a poll interval, bounded by the deadline
    return None


def _drain(url: str, key: str, node_id: str, timeout_s: float) -> str:
    """Drains the node through the admin API and waits for its instances to be gone; what happened."""
    from infra.admin_client import AdminApiError, AdminClient, AdminUnreachable

    async def main() -> str:
        async with AdminClient(url, key, timeout_s=60.0) as admin:
            await admin.drain(node_id)
            deadline = time.monotonic() + timeout_s
            while True:
                left = [i["instance_id"] for i in (await admin.status())["instances"] if i["node_id"] == node_id]
                if not left:
                    return "drained: its requests moved to other nodes"
                if time.monotonic() >= deadline:
                    return f"drain timed out after {timeout_s:g} s with {len(left)} instance(s) left"
                await asyncio.sleep(0.5)  # a poll interval, bounded by the deadline

    try:
        return asyncio.run(main())
    except (AdminApiError, AdminUnreachable) as exc:
        return f"not drained: {exc}"


def node_environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment entries carrying this node's own store settings (`storage.NodeSettings`)
    to every Ray process it starts; raises `UsageError` for a bad flag."""
    from storage.node_settings import NodeSettings

    try:
        settings = NodeSettings.from_gb(args.ssd_dir, args.ssd_capacity_gb, args.dram_capacity_gb,
                                        args.worker_memory_gb)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return settings.to_env()


def cmd_join(args: argparse.Namespace) -> int:
    import os

    from controller import NODE_ID_PREFIX_CHARS
    from infra.admin_client import resolve_endpoint

    argv = _ray_start_argv(args)
    env = {**os.environ, **node_environment(args)}
    url, key = resolve_endpoint(args.url, args.admin_key, Path(args.state).expanduser())
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Its own process group: a Ctrl-C in the terminal reaches this command, which drains first,
    # rather than Ray's processes, which would leave at once.
    process = subprocess.Popen(argv, start_new_session=True, env=env)
    try:
        node_id = _node_id(process, args.start_timeout_s)
        if node_id is None:
            print(f"[thaw] the node did not start (ray start exited {process.poll()}); see its output above",
                  file=sys.stderr, flush=True)
            return 1
        platform_node = node_id[:NODE_ID_PREFIX_CHARS]
        print(f"[thaw] joined the cluster at {args.address} as node {platform_node} (Ray node {node_id}); the "
              f"platform places models here within a reconcile tick. Ctrl-C drains the node, then leaves",
              flush=True)
        while not stop.wait(0.5) and process.poll() is None:
            pass
        if process.poll() is not None:
            print(f"[thaw] the Ray node stopped (exit {process.returncode})", file=sys.stderr, flush=True)
            return 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the drain short
        if key is None:
            outcome = "not drained: no admin key (--admin-key or $THAW_ADMIN_KEY); its requests resume elsewhere"
        else:
            outcome = _drain(url, key, platform_node, args.drain_timeout_s)
        print(f"[thaw] node {platform_node} {outcome}; stopping it", file=sys.stderr, flush=True)
        return 0
    finally:
        if process.poll() is None:
            process.terminate()  # `ray start --block` stops this node's Ray processes on SIGTERM
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_join_command(sub: argparse._SubParsersAction) -> None:
    from infra.platform_config import default_state_dir

    join = sub.add_parser("join", help="make this machine a node of a running platform (ray start --block), "
                                       "draining it on Ctrl-C before it leaves")
    join.add_argument("--address", required=True, help="the cluster's head, HOST:6379 (Ray's GCS address)")
    join.add_argument("--num-cpus", type=int, default=None, help="CPUs this node offers (default: all)")
    join.add_argument("--num-gpus", type=int, default=None, help="GPUs this node offers (default: all)")
    join.add_argument("--resource", action="append", metavar="NAME[=AMOUNT]",
                      help="a custom Ray resource this node offers (repeatable), e.g. the platform's "
                           "--services-resource name to host the controller and gateway replicas")
    join.add_argument("--temp-dir", default=None, help="Ray's temp dir for this node (default: Ray's)")
    join.add_argument("--ssd-dir", default=None, help="where this node's SSD cache lives (default: the platform's)")
    join.add_argument("--ssd-capacity-gb", type=float, default=None,
                      help="this node's SSD cache size (default: the platform's --ssd-capacity-gb)")
    join.add_argument("--dram-capacity-gb", type=float, default=None,
                      help="this node's DRAM cache size, 0 for none (default: the platform's --dram-capacity-gb)")
    join.add_argument("--worker-memory-gb", type=float, default=None,
                      help="the memory this node's model instances share, weights plus KV pools (default: the "
                           "platform's --worker-memory-gb; a budget here makes memory the slot on this node)")
    join.add_argument("--url", default=None, help="the platform's gateway, for the drain on leaving "
                                                  "(default: $THAW_URL, or --state's)")
    join.add_argument("--admin-key", default=None, help="the admin key, for the drain on leaving (default: "
                                                        "$THAW_ADMIN_KEY, or --state's)")
    join.add_argument("--state", default=str(default_state_dir()), help="a state directory holding the gateway's "
                                                                         "URL and admin key (default: ~/.thaw)")
    join.add_argument("--drain-timeout-s", type=float, default=120.0,
                      help="how long leaving waits for the node's instances to move off")
    join.add_argument("--start-timeout-s", type=float, default=120.0, help="how long the node may take to start")
    join.set_defaults(func=cmd_join)
