"""``thaw serve``: run a platform in the foreground until Ctrl-C (or SIGTERM), then stop it cleanly.

Starts a local Ray bound to loopback (or joins ``--address``), the controller, node stores and
the gateway (see `infra.platform`), prints where it listens and — on the first start only — the
admin key, then waits. Flags are checked before anything starts: ``--no-auth`` only with a
loopback ``--host`` (every caller would be admin), ``--metrics-token-file`` only with keys. A signal stops the gateway, the controller with its workers and node stores, and the
local Ray, and the command exits 0; a second Ctrl-C while stopping is ignored, so the stop is
never cut short into leftovers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from infra.cli_errors import UsageError
from infra.platform_config import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_PORT, GIB, HTTP_PROXY_LOCATIONS, STATE_STORE_ENV,
                                   PlatformConfig, default_state_dir)


# The embedded default: models share a CPU node by memory (ARCHITECTURE.md, "Slot hosts"), so a
# few small models deployed beside the demo stay resident side by side and alternating between
# them loads nothing. Idle instances cost memory, not CPU; busy ones share the cores.
DEFAULT_SHARED_SLOTS = 4
DEFAULT_WORKER_MEMORY_SHARE = 0.25  # of this machine's RAM


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def shared_slot_defaults(worker_slots: int | None, worker_memory_gb: float | None) -> tuple[int, float | None]:
    """(worker slots per CPU node, worker memory budget in GB or None) from the flags given.

    Neither flag: `DEFAULT_SHARED_SLOTS` slots sharing `DEFAULT_WORKER_MEMORY_SHARE` of the RAM.
    Only ``--worker-slots``: slots alone bound a node, as before budgets existed. Only
    ``--worker-memory-gb``: that budget over the default slots."""
    if worker_memory_gb is None and worker_slots is None:
        ram = machine_memory_bytes()
        worker_memory_gb = ram * DEFAULT_WORKER_MEMORY_SHARE / GIB if ram else None
    return (DEFAULT_SHARED_SLOTS if worker_slots is None else worker_slots), worker_memory_gb


def _config_from_args(args: argparse.Namespace) -> PlatformConfig:
    # Checked here so the message names the flag the user typed, not the derived byte count.
    if args.spare_workers < 0:
        raise UsageError(f"--spare-workers must be 0 or more (spare worker processes per node), got {args.spare_workers}")
    if not args.spare_memory_gb >= 0:  # also refuses nan
        raise UsageError(f"--spare-memory-gb must be 0 or more (GB each spare faults ahead for a model's weights), "
                         f"got {args.spare_memory_gb:g}")
    worker_slots, worker_memory_gb = shared_slot_defaults(args.worker_slots, args.worker_memory_gb)
    if worker_memory_gb is not None and not 0 < worker_memory_gb < float("inf"):
        raise UsageError(f"--worker-memory-gb must be more than 0 (GB of memory each node's model instances share: "
                         f"weights plus KV pools; leave it out to bound instances by --worker-slots alone), "
                         f"got {worker_memory_gb:g}")
    if args.models_per_process < 1:
        raise UsageError(f"--models-per-process must be 1 or more (models one worker process may hold), "
                         f"got {args.models_per_process}")
    gpu_memory_gb = args.gpu_memory_gb
    if gpu_memory_gb is not None and not 0 < gpu_memory_gb < float("inf"):
        raise UsageError(f"--gpu-memory-gb must be more than 0 (GB of each GPU's memory its models share: weights "
                         f"plus KV pools), got {gpu_memory_gb:g}")
    if gpu_memory_gb is not None and args.models_per_process < 2:
        raise UsageError("--gpu-memory-gb shares each GPU among the models of its slot host: give "
                         "--models-per-process 2 or more with it (the most models one GPU may hold)")
    sleep_gb = args.gpu_sleep_memory_gb
    if sleep_gb is not None and not 0 <= sleep_gb < float("inf"):
        raise UsageError(f"--gpu-sleep-memory-gb must be 0 or more (GB of pinned host memory per GPU its sleeping "
                         f"models may hold; 0: none sleeps), got {sleep_gb:g}")
    if not 0 < args.body_timeout_s < float("inf"):
        raise UsageError(f"--body-timeout-s must be more than 0 (seconds a request body may take to arrive), "
                         f"got {args.body_timeout_s:g}")
    upload_mb_s = args.repository_upload_mb_s
    if upload_mb_s is not None and not 0 < upload_mb_s < float("inf"):
        raise UsageError(f"--repository-upload-mb-s must be more than 0 (MB/s deploys may upload into the "
                         f"repository; leave it out for no cap), got {upload_mb_s:g}")
    if not 0 <= args.peer_link_gbps < float("inf"):
        raise UsageError(f"--peer-link-gbps must be 0 or more (GB/s assumed for streaming weights from a running "
                         f"instance; 0: never), got {args.peer_link_gbps:g}")
    try:
        return PlatformConfig.create(
            state_dir=Path(args.state).expanduser().absolute(), state_store=args.state_store,
            repository_uri=args.repository, repository_endpoint_url=args.endpoint_url, ray_address=args.address,
            repository_upload_bytes_per_s=None if upload_mb_s is None else upload_mb_s * 1e6,
            host=args.host, port=args.port, namespace=args.namespace, auth=not args.no_auth, num_cpus=args.num_cpus,
            metrics_token_file=(Path(args.metrics_token_file).expanduser().absolute()
                                if args.metrics_token_file is not None else None),
            gateway_body_timeout_s=args.body_timeout_s,
            cpu_worker_slots_per_node=worker_slots, ssd_capacity_bytes=int(args.ssd_capacity_gb * GIB),
            worker_memory_bytes=None if worker_memory_gb is None else max(1, int(worker_memory_gb * GIB)),
            dram_capacity_bytes=int(args.dram_capacity_gb * GIB), calibrate=not args.no_calibrate,
            ssd_dir=Path(args.ssd_dir).expanduser().absolute() if args.ssd_dir is not None else None,
            num_gateway_replicas=args.gateway_replicas, spare_workers_per_node=args.spare_workers,
            spare_weight_bytes=int(args.spare_memory_gb * GIB), peer_link_bytes_per_s=args.peer_link_gbps * 1e9,
            models_per_process=args.models_per_process,
            gpu_memory_bytes=None if gpu_memory_gb is None else max(1, int(gpu_memory_gb * GIB)),
            gpu_sleep_memory_bytes=None if sleep_gb is None else int(sleep_gb * GIB),
            slot_sharing=not args.no_slot_sharing, state_dir_shared=args.state_shared,
            admin_key_source=(Path(args.admin_key_file).expanduser().absolute()
                              if args.admin_key_file is not None else None),
            head_only=args.head_only, http_proxies=args.http_proxies, services_resource=args.services_resource,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from infra.platform import Platform

    config = _config_from_args(args)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    platform = Platform(config)
    started = platform.start(demo=args.demo, reset_admin_key=args.reset_admin_key)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _print_banner(config, started)
        stop.wait()
        print("[thaw] stopping ...", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
    finally:
        platform.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("[thaw] stopped", file=sys.stderr, flush=True)
    return 0


def _print_banner(config: PlatformConfig, started) -> None:
    lines = [f"[thaw] serving at {started.url} (OpenAI-compatible: {started.url}/v1), state in {config.state_dir}"]
    if not config.auth:
        lines.append("[thaw] --no-auth: no API key needed, every caller is admin; answering only requests "
                     "addressed to 127.0.0.1, localhost or [::1]")
    elif started.new_admin_key is not None:
        lines.append(f"[thaw] admin key (shown once; also saved to {config.admin_key_file}, mode 0600):")
        lines.append(f"    {started.new_admin_key}")
    else:
        lines.append(f"[thaw] admin key: in {config.admin_key_file} (thaw serve --reset-admin-key makes a new one)")
    if started.demo_model_id is not None:
        key = "no-key" if not config.auth else f"$(cat {config.admin_key_file})"
        lines.append(f"[thaw] demo model {started.demo_model_id} deployed; try:")
        lines.append(f"    curl -N {started.url}/v1/chat/completions -H \"Authorization: Bearer {key}\" "
                     f"-H 'Content-Type: application/json' -d '{{\"model\": \"{started.demo_model_id}\", "
                     f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"stream\": true}}'")
    lines.append("[thaw] Ctrl-C stops the platform")
    print("\n".join(lines), flush=True)


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the platform (Ray, controller, node stores, gateway) until Ctrl-C")
    serve.add_argument("--demo", action="store_true",
                       help="write the demo model into the state directory (if missing) and deploy it as demo/tiny")
    serve.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local Ray")
    serve.add_argument("--head-only", action="store_true",
                       help="with --address: this node runs the controller, the gateway and its HTTP proxy but no "
                            "model; models go to the cluster's other nodes (e.g. a head without GPUs)")
    serve.add_argument("--services-resource", default=None, metavar="NAME",
                       help="run the controller and the gateway replicas only on Ray nodes started with this custom "
                            "resource (ray start --resources '{\"NAME\": 1}'), e.g. the CPU nodes of a GPU cluster")
    serve.add_argument("--http-proxies", choices=sorted(HTTP_PROXY_LOCATIONS), default="every-node",
                       help="where Ray Serve runs the gateway's HTTP proxy: on every node (default; put a load "
                            "balancer in front) or on this node only (several Ray nodes on one machine need it)")
    serve.add_argument("--host", default="127.0.0.1", help="address the gateway listens on (0.0.0.0: all; "
                                                            "with --no-auth only a loopback address)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--state", default=str(default_state_dir()),
                       help="state directory: SQLite state, SSD cache, admin key, demo model "
                            "(default: $THAW_STATE_DIR or ~/.thaw)")
    serve.add_argument("--state-shared", action="store_true",
                       help="with --address: every Ray node sees --state (one machine, or shared storage), so the "
                            "default SQLite state store may be used; otherwise joining a cluster needs --state-store "
                            "redis://...")
    serve.add_argument("--state-store", default=os.environ.get(STATE_STORE_ENV) or None,
                       help=f"state store URL (redis://[:PASSWORD@]host:port/db for a cluster; ${STATE_STORE_ENV} "
                            "keeps a password off the command line); default: SQLite in the state directory")
    serve.add_argument("--repository", default=None, help="model repository: a directory or s3://bucket/prefix "
                                                           "(default: STATE/repository)")
    serve.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint of the repository")
    serve.add_argument("--repository-upload-mb-s", type=float, default=None, metavar="MB_PER_S",
                       help="cap what deploys upload into the repository, in MB/s over all of them, so they leave "
                            "the link to the nodes' fetches (default: no cap)")
    serve.add_argument("--namespace", default="thaw", help="Ray namespace of this platform's actors")
    serve.add_argument("--no-auth", action="store_true",
                       help="no API keys: anyone on this machine may call anything; only with a loopback --host, "
                            "and only requests addressed to 127.0.0.1, localhost or [::1] are answered")
    serve.add_argument("--metrics-token-file", default=None,
                       help="file holding a token (e.g. `openssl rand -hex 32`) that may read /metrics, for "
                            "Prometheus; without it /metrics needs the admin key")
    serve.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help="seconds a request body may take to arrive before the gateway answers 408")
    serve.add_argument("--reset-admin-key", action="store_true", help="revoke the admin key and print a new one")
    serve.add_argument("--admin-key-file", default=None,
                       help="use the admin key in this file (e.g. a mounted secret; `thaw keygen` makes one): it is "
                            "made an admin key if it is not one, copied to the state directory, never printed")
    serve.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    serve.add_argument("--worker-slots", type=int, default=None,
                       help=f"model instances per CPU-only node (default {DEFAULT_SHARED_SLOTS}, sharing "
                            f"--worker-memory-gb; given alone, slots alone bound a node)")
    serve.add_argument("--worker-memory-gb", type=float, default=None,
                       help=f"memory each node's model instances share (weights plus KV pools): instances are packed "
                            f"by it and idle ones evicted until a newcomer fits (default: "
                            f"{DEFAULT_WORKER_MEMORY_SHARE:.0%} of this machine's RAM unless --worker-slots is given)")
    serve.add_argument("--models-per-process", type=int, default=1,
                       help="slot hosts: where nodes share a worker memory budget, each warm worker process holds "
                            "up to this many models, their engine steps taking turns (default: 1, a process per "
                            "model)")
    serve.add_argument("--gpu-memory-gb", type=float, default=None,
                       help="GPU nodes: memory of each GPU that its models share (weights plus KV pools): each GPU "
                            "gets one warm slot host holding up to --models-per-process models, packed by memory, "
                            "idle ones put to sleep in pinned host memory (default: off, a GPU per model)")
    serve.add_argument("--gpu-sleep-memory-gb", type=float, default=None,
                       help="GPU nodes: pinned host memory per GPU that its sleeping models' weights may hold; past "
                            "it the longest asleep are stopped (default: --gpu-memory-gb)")
    serve.add_argument("--ssd-capacity-gb", type=float, default=64.0,
                       help="SSD cache per node (a node that joins may give its own: thaw join --ssd-capacity-gb)")
    serve.add_argument("--ssd-dir", default=None, help="where the nodes' SSD caches live (default: STATE/ssd-cache; "
                                                       "a node that joins may give its own: thaw join --ssd-dir)")
    serve.add_argument("--dram-capacity-gb", type=float, default=8.0, help="DRAM cache per node (0: none)")
    serve.add_argument("--no-calibrate", action="store_true", help="skip the node stores' bandwidth probes")
    serve.add_argument("--gateway-replicas", type=int, default=1)
    serve.add_argument("--spare-workers", type=int, default=1,
                       help="model-less worker processes kept started per node for fast cold starts (0: none)")
    serve.add_argument("--spare-memory-gb", type=float, default=0.0,
                       help="memory each spare faults ahead for its future model's weights (faster loads of "
                            "models up to this size; resident while idle)")
    serve.add_argument("--peer-link-gbps", type=float, default=1.5,
                       help="GB/s assumed for streaming a new instance's weights from a running one; it streams "
                            "when that beats its node's tier (0: never)")
    serve.add_argument("--no-slot-sharing", action="store_true",
                       help="keep-alive as a hard lease: an idle instance keeps its slot until its keep-alive ends, "
                            "and no busy one is preempted (by default slots go to models with waiting requests)")
    serve.set_defaults(func=cmd_serve)
