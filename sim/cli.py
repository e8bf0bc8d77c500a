"""`thaw simulate`: run the trace-driven simulator for one policy or all four, and report.

    thaw simulate --models N --nodes N --gpus-per-node N --hours H [--trace DIR] --policy NAME|all
                  [--seed S] [--json] [--out DIR] [--quick]

A progress bar (tqdm) on stderr follows simulated time across the policies. Output: a table per
policy, or with `--json` one JSON object per line per policy (`sim.report.result_line`); with
`--out`, results.jsonl and the two plots are written there too. `--quick` replaces the scenario
with a small one (50 models, 2 nodes x 4 GPUs, 15 minutes) that runs in seconds: the suite's
smoke test and a first look.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["add_simulate_command", "run_simulate_command"]

QUICK = {"models": 50, "nodes": 2, "gpus_per_node": 4, "hours": 0.25}


def add_simulate_command(sub) -> None:
    """Registers `simulate` on the `thaw` command's subparsers."""
    from sim.policies import POLICY_NAMES

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
    p.add_argument("--json", action="store_true", help="one JSON object per line per policy")
    p.add_argument("--out", default=None, help="folder for results.jsonl, ttft_cdf.png and accelerators.png")
    p.add_argument("--quick", action="store_true", help="a small scenario that runs in seconds (ignores the sizes)")
    p.set_defaults(func=run_simulate_command)


def run_simulate_command(args) -> int:
    from tqdm import tqdm

    from sim.policies import POLICY_NAMES
    from sim.report import format_table, result_line, write_report
    from sim.simulator import SimConfig, run_simulation

    sizes = dict(models=args.models, nodes=args.nodes, gpus_per_node=args.gpus_per_node, hours=args.hours)
    if args.quick:
        sizes = dict(QUICK)
    policies = list(POLICY_NAMES) if args.policy == "all" else [args.policy]
    configs = [SimConfig(num_models=sizes["models"], num_nodes=sizes["nodes"], gpus_per_node=sizes["gpus_per_node"],
                         hours=sizes["hours"], seed=args.seed, policy=name,
                         trace_dir=Path(args.trace) if args.trace else None, source=args.source,
                         slo_ttft_s=args.slo_ttft_s) for name in policies]  # all validated before any runs
    horizon_s = sizes["hours"] * 3600.0
    results = []
    with tqdm(total=round(horizon_s * len(configs)), unit="sim-s", file=sys.stderr, dynamic_ncols=True,
              disable=None) as bar:
        for i, config in enumerate(configs):
            bar.set_description(config.policy)
            base = i * horizon_s

            def progress(sim_s: float, total_s: float, base: float = base) -> None:
                bar.update(max(0, round(base + sim_s) - bar.n))

            results.append(run_simulation(config, progress))
    if args.json:
        for result in results:
            print(result_line(result), flush=True)
    else:
        print(format_table(results))
    if args.out:
        paths = write_report(results, Path(args.out))
        print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
