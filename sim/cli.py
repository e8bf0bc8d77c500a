"""`thaw simulate`: run the trace-driven simulator for one policy or all four, and report.

    thaw simulate --models N --nodes N --gpus-per-node N --hours H [--trace DIR] --policy NAME|all
                  [--seed S] [--staged ssd|dram] [--json] [--out DIR] [--quick] [--workers N]
                  [--thaw-min-idle-s S] [--thaw-min-run-s S] [--thaw-no-preempt] [--thaw-preempt-after-wait] [--thaw-no-slot-reclaim]
                  [--thaw-max-wait-before-preempt-s S] [--thaw-no-slot-sharing] [--thaw-models-per-gpu N] [--thaw-no-sleep]
                  [--concurrent-loads N] [--short-fetch-ratio R]

A progress bar (tqdm) on stderr follows simulated time across the policies. With `--policy all`
the policies run side by side in `--workers` processes (default: one per CPU core, at most one
per policy); each run is the same function of its config either way, so the figures do not
depend on it. The `--thaw-*` flags set the controller's slot-sharing settings for Thaw's policy
(`SlotSharingSettings`, the model spec's `max_wait_before_preempt_s`), so a setting is studied
with the controller's own code. Output: a table per
policy, or with `--json` one JSON object per line per policy (`sim.report.result_line`); with
`--out`, results.jsonl and the two plots are written there too. `--quick` replaces the scenario
with a small one (50 models, 2 nodes x 4 GPUs, 15 minutes) that runs in seconds: the suite's
smoke test and a first look.
"""

from __future__ import annotations

import os
import queue
import sys
from pathlib import Path

__all__ = ["add_simulate_command", "run_simulate_command"]

QUICK = {"models": 50, "nodes": 2, "gpus_per_node": 4, "hours": 0.25}


def add_simulate_command(sub) -> None:
    """Registers `simulate` on the `thaw` command's subparsers."""
    from sim.policies import POLICY_NAMES, ThawAutoscaling

    spec = ThawAutoscaling()

    p = sub.add_parser("simulate", help="replay a workload on a simulated cluster under Thaw's and its peers' policies")
    p.add_argument("--models", type=int, default=1000, help="models in the catalog (default 1000)")
    p.add_argument("--nodes", type=int, default=100, help="nodes (default 100)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="accelerators per node (default 8)")
    p.add_argument("--hours", type=float, default=1.0, help="simulated hours of arrivals (default 1)")
    p.add_argument("--trace", default=None, help="folder of raw traces to fit the workload from (e.g. "
                                                 "../shared/traces); default: the bundled fit")
    p.add_argument("--source", default="azure_functions", help="workload source: azure_functions, servegen or "
                                                               "azure_llm (see sim/workload.py)")
    p.add_argument("--policy", default="all", choices=[*POLICY_NAMES, "all"], help="policy to run (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float, default=5.0, help="TTFT bound of the SLO attainment (default 5 s)")
    p.add_argument("--staged", choices=("ssd", "dram"), default=None,
                   help="every node's SSD (and with dram, its DRAM) holds every checkpoint when the run starts, as "
                        "far as it fits, so no request waits for a first fetch from the repository (default: the "
                        "repository only)")
    p.add_argument("--concurrent-loads", type=int, default=1,
                   help="a node's loads from its SSD and the repository in flight at once, sharing its read path "
                        "evenly, the rest queued (default 1: one at a time, as the node store fetches)")
    p.add_argument("--short-fetch-ratio", type=float, default=8.0,
                   help="one load at a time, a load R times shorter than another goes ahead of it, pausing it "
                        "if it is in flight (default 8, as the node store, measured best; 0: strict arrival order)")
    p.add_argument("--json", action="store_true", help="one JSON object per line per policy")
    p.add_argument("--out", default=None, help="folder for results.jsonl, ttft_cdf.png and accelerators.png")
    p.add_argument("--quick", action="store_true", help="a small scenario that runs in seconds (ignores the sizes)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes running policies side by side (default: CPU cores, at most one per policy)")
    p.add_argument("--thaw-min-idle-s", type=float, default=None,
                   help="Thaw: an idle instance is evicted only after this long idle (controller default 0.5)")
    p.add_argument("--thaw-min-run-s", type=float, default=None,
                   help="Thaw: a busy instance is preempted only after serving this long (controller default 2)")
    p.add_argument("--thaw-no-preempt", action="store_true", help="Thaw: never preempt a busy instance")
    p.add_argument("--thaw-preempt-after-wait", action="store_true",
                   help="Thaw: preempt an equal-priority instance after the bounded wait, as before deadlines "
                        "(SlotSharingSettings.deadline_preemption=False)")
    p.add_argument("--thaw-evict-for-lost", action="store_true",
                   help="Thaw: evict an idle instance for a waiting model even when none of its requests can meet "
                        "its deadline any more, as before deadlines (SlotSharingSettings.deadline_eviction=False)")
    p.add_argument("--thaw-lost-wait-s", type=float, default=None,
                   help="Thaw: how long a waiting model whose requests are past saving waits before it evicts "
                        "(EvictionSettings.lost_wait_s, controller default 60)")
    p.add_argument("--thaw-order-by-age", action="store_true",
                   help="Thaw: waiting models get slots by oldest request alone, as before deadlines "
                        "(SlotSharingSettings.deadline_order=False)")
    p.add_argument("--thaw-contended-keep-alive-s", type=float, default=None,
                   help="Thaw: the least keep-alive while a model found no free slot within that long "
                        "(SlotSharingSettings.contended_keep_alive_s; default 60, a GPU deployment's; 0: off)")
    p.add_argument("--thaw-no-slot-sharing", action="store_true",
                   help="Thaw: no slot sharing, as `thaw serve --no-slot-sharing` (keep-alive a hard lease, no "
                        "eviction or preemption; not with the other slot-sharing flags)")
    p.add_argument("--thaw-no-slot-reclaim", action="store_true",
                   help="Thaw: never free a slot by migrating an instance's requests to a sibling (controller "
                        "slot_reclaim=None)")
    p.add_argument("--thaw-models-per-gpu", type=int, default=1,
                   help="Thaw: each GPU a slot host holding up to N models at once, as far as their weights and KV "
                        "pools fit its memory, their decode steps taking turns (default 1: a GPU per model; the "
                        "other policies always have one)")
    p.add_argument("--thaw-no-sleep", action="store_true",
                   help="Thaw, on slot hosts: an idle instance scaled down stops instead of sleeping (its weights in "
                        "host memory, woken over the link), as the controller's sleep_idle_instances=False")
    p.add_argument("--thaw-max-wait-before-preempt-s", type=float, default=None,
                   help="Thaw: the bounded wait before preempting (model spec default 5)")
    p.add_argument("--thaw-keep-alive-per-restart", type=float, default=spec.keep_alive_per_restart,
                   help="Thaw: keep-alive as this multiple of a model's restart time, 10-180 s (default "
                        f"{spec.keep_alive_per_restart:g}); 0: the fixed keep-alive every policy gets")
    p.add_argument("--thaw-upscale-delay-s", type=float, default=spec.upscale_delay_s,
                   help=f"Thaw: the spec's upscale_delay_s (default {spec.upscale_delay_s:g})")
    p.add_argument("--thaw-downscale-delay-s", type=float, default=spec.downscale_delay_s,
                   help=f"Thaw: the spec's downscale_delay_s (default {spec.downscale_delay_s:g})")
    p.add_argument("--thaw-controller-defaults", action="store_true",
                   help="Thaw: the controller's own spec defaults (fixed keep-alive, delays 1 s / 30 s) instead of "
                        "the three settings above")
    p.set_defaults(func=run_simulate_command)


def _thaw_sharing(args):
    """The `SlotSharingSettings` the --thaw-* flags ask for (None: the controller's defaults)."""
    if args.thaw_min_idle_s is None and args.thaw_min_run_s is None and not args.thaw_no_preempt \
            and not args.thaw_preempt_after_wait and not args.thaw_evict_for_lost and args.thaw_lost_wait_s is None \
            and not args.thaw_order_by_age and args.thaw_contended_keep_alive_s is None:
        return None
    import dataclasses

    from controller import SlotSharingSettings
    from sim.policies import THAW_SHARING

    base = THAW_SHARING
    eviction = base.eviction
    if args.thaw_min_idle_s is not None:
        eviction = dataclasses.replace(eviction, min_idle_s=args.thaw_min_idle_s)
    if args.thaw_lost_wait_s is not None:
        eviction = dataclasses.replace(eviction, lost_wait_s=args.thaw_lost_wait_s)
    return SlotSharingSettings(eviction=eviction, preempt=not args.thaw_no_preempt,
                               deadline_preemption=not args.thaw_preempt_after_wait,
                               deadline_eviction=not args.thaw_evict_for_lost,
                               deadline_order=not args.thaw_order_by_age,
                               contended_keep_alive_s=(base.contended_keep_alive_s if args.thaw_contended_keep_alive_s
                                                       is None else args.thaw_contended_keep_alive_s),
                               min_run_s=base.min_run_s if args.thaw_min_run_s is None else args.thaw_min_run_s)


def _thaw_spec(args):
    """The `ThawAutoscaling` the --thaw-* spec flags ask for."""
    from sim.policies import ThawAutoscaling

    if args.thaw_controller_defaults:
        return ThawAutoscaling.controller_defaults()
    for flag, value in (("--thaw-keep-alive-per-restart", args.thaw_keep_alive_per_restart),
                        ("--thaw-upscale-delay-s", args.thaw_upscale_delay_s),
                        ("--thaw-downscale-delay-s", args.thaw_downscale_delay_s)):
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{flag} must be a finite number >= 0, got {value:g}")
    return ThawAutoscaling(keep_alive_per_restart=args.thaw_keep_alive_per_restart or None,
                           upscale_delay_s=args.thaw_upscale_delay_s, downscale_delay_s=args.thaw_downscale_delay_s)


def _run_one(config, progress_queue, index: int):
    """One policy's run in a worker process; progress goes back through `progress_queue`."""
    from sim.simulator import run_simulation

    return run_simulation(config, lambda sim_s, total_s: progress_queue.put((index, sim_s)))


def run_policies(configs, progress, workers: int) -> list:
    """Runs every config, `workers` at a time in processes (1: in this process); results in the
    configs' order. `progress(index, sim_s)` follows each run."""
    from sim.simulator import run_simulation

    if workers <= 1 or len(configs) <= 1:
        return [run_simulation(c, lambda sim_s, total_s, i=i: progress(i, sim_s)) for i, c in enumerate(configs)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with context.Manager() as manager, ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        updates = manager.Queue()
        futures = [pool.submit(_run_one, config, updates, i) for i, config in enumerate(configs)]
        while not all(f.done() for f in futures):
            try:
                progress(*updates.get(timeout=0.5))
            except queue.Empty:
                pass
        while not updates.empty():
            progress(*updates.get())
        return [f.result() for f in futures]


def run_simulate_command(args) -> int:
    from tqdm import tqdm

    from sim.policies import POLICY_NAMES
    from sim.report import format_table, result_line, write_report
    from sim.simulator import SimConfig

    sizes = dict(models=args.models, nodes=args.nodes, gpus_per_node=args.gpus_per_node, hours=args.hours)
    if args.quick:
        sizes = dict(QUICK)
    policies = list(POLICY_NAMES) if args.policy == "all" else [args.policy]
    try:  # bad input is exit 2 with the message, as every thaw command does
        thaw_spec = _thaw_spec(args)
        if args.thaw_no_slot_sharing and _thaw_sharing(args) is not None:
            raise ValueError("--thaw-no-slot-sharing turns eviction and preemption off; it cannot be combined "
                             "with the other slot-sharing flags (--thaw-min-idle-s, --thaw-no-preempt, ...)")
        configs = [SimConfig(num_models=sizes["models"], num_nodes=sizes["nodes"], gpus_per_node=sizes["gpus_per_node"],
                             hours=sizes["hours"], seed=args.seed, policy=name,
                             trace_dir=Path(args.trace) if args.trace else None, source=args.source,
                             slo_ttft_s=args.slo_ttft_s, thaw_sharing=_thaw_sharing(args),
                             thaw_max_wait_before_preempt_s=args.thaw_max_wait_before_preempt_s,
                             thaw_spec=thaw_spec, thaw_slot_reclaim=not args.thaw_no_slot_reclaim,
                             thaw_slot_sharing=not args.thaw_no_slot_sharing, staged_tier=args.staged,
                             thaw_models_per_gpu=args.thaw_models_per_gpu, thaw_sleep=not args.thaw_no_sleep,
                             concurrent_loads=args.concurrent_loads, short_fetch_ratio=args.short_fetch_ratio)
                   for name in policies]  # all validated before any runs
        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
    except ValueError as exc:
        print(f"thaw simulate: error: {exc}", file=sys.stderr)
        return 2
    workers = min(len(configs), args.workers if args.workers is not None else (os.cpu_count() or 1))
    horizon_s = sizes["hours"] * 3600.0
    done = [0.0] * len(configs)
    with tqdm(total=round(horizon_s * len(configs)), unit="sim-s", file=sys.stderr, dynamic_ncols=True,
              disable=None) as bar:
        bar.set_description(",".join(c.policy for c in configs))

        def progress(index: int, sim_s: float) -> None:
            done[index] = max(done[index], min(sim_s, horizon_s))
            bar.update(max(0, round(sum(done)) - bar.n))

        results = run_policies(configs, progress, workers)
    if args.json:
        for result in results:
            print(result_line(result), flush=True)
    else:
        print(format_table(results))
    if args.out:
        paths = write_report(results, Path(args.out))
        print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
