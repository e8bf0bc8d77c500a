"""Density (issue 39): how many models a policy serves per accelerator at SLO attainment >= 0.99.

The simulator's cluster of `thaw simulate --quick` (2 nodes x 4 H100), its workload model (the
bundled fit: Azure Functions popularity and per-minute shape, ServeGen burstiness, Azure LLM token
counts; the per-model load fixed, so total load grows with the catalog) and its catalog's size mix,
run for an hour with N models for each N of a grid and each seed, under Thaw's policy with its
GPUs as slot hosts (`thaw_slot_hosts`: each GPU holds up to `--models-per-gpu` models at once as
far as their weights and KV pools fit its memory, their decode steps taking turns; `thaw simulate
--thaw-models-per-gpu`), Thaw's policy with a GPU per model (`thaw`), ServerlessLLM-like and
Ray-Serve-like (the same policies `thaw simulate --policy all` compares; neither peer shares a
GPU's memory between models).

Every node starts with every checkpoint on its SSD and, as far as they fit, the most requested
first, in its DRAM (`SimConfig.staged_tier`, ``thaw simulate --staged dram``): the cluster has served the catalog
before, so what is measured is sharing slots, not a model's first fetch from the repository
(which every policy pays alike and which alone keeps a 15-minute contended run far below 0.99;
BENCHMARKS.md). Ray-Serve-like reads the repository on every start all the same, as Ray Serve does.

A policy's density is the largest N of the grid such that it attains the SLO (TTFT <= 5 s) for
at least `--threshold` of the requests on every seed, at that N and at every smaller N of the
grid, divided by the accelerators; 0 when even the smallest N misses. One JSON line on stdout with
each policy's figure, its attainment per N and seed, Thaw's ratio (with slot hosts) to each peer
and to the anchor (Aegaeon, SOSP '25: up to 7 models per GPU); progress on stderr.

    python bench/density.py [--quick] [--threshold 0.99] [--workers N] [--models-per-gpu 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (`python bench/density.py`): make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POLICIES = ("thaw_slot_hosts", "thaw", "serverlessllm", "rayserve")  # the first is "ours"
PEERS = ("serverlessllm", "rayserve")
DEFAULT_MODELS_PER_GPU = 8
ANCHOR_MODELS_PER_GPU = 7.0  # Aegaeon (SOSP '25): up to 7 models per GPU


@dataclass(frozen=True)
class DensityMode:
    name: str
    num_nodes: int
    gpus_per_node: int
    hours: float
    grid: tuple[int, ...]  # catalog sizes, ascending
    seeds: tuple[int, ...]

    @property
    def accelerators(self) -> int:
        return self.num_nodes * self.gpus_per_node


FULL = DensityMode("full", num_nodes=2, gpus_per_node=4, hours=1.0,
                   grid=(8, 16, 20, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128), seeds=(0, 1, 2, 3, 4))
QUICK = DensityMode("quick", num_nodes=1, gpus_per_node=4, hours=0.25, grid=(4, 8, 16), seeds=(0,))


def max_models(attainment: Mapping[int, Sequence[float]], threshold: float) -> int:
    """The largest catalog size N such that every N' <= N of the grid attains `threshold` on every
    seed (0: the smallest misses). A larger N that passes after one that missed does not count:
    the density is where the policy stops holding the SLO, not a lucky seed past it."""
    best = 0
    for n in sorted(attainment):
        if not attainment[n] or min(attainment[n]) < threshold:
            break
        best = n
    return best


def _one(job: tuple[str, int, int, DensityMode, int]) -> tuple[str, int, int, float, float | None]:
    from sim.simulator import SimConfig, run_simulation

    policy, n, seed, mode, models_per_gpu = job
    hosts = policy == "thaw_slot_hosts"
    result = run_simulation(SimConfig(num_models=n, num_nodes=mode.num_nodes, gpus_per_node=mode.gpus_per_node,
                                      hours=mode.hours, seed=seed, policy="thaw" if hosts else policy,
                                      staged_tier="dram", thaw_models_per_gpu=models_per_gpu if hosts else 1))
    p99 = result.ttft_p99_s if math.isfinite(result.ttft_p99_s) else None  # inf/NaN: some request never served
    return policy, n, seed, result.slo_attainment, p99


def run(mode: DensityMode, threshold: float, workers: int,
        models_per_gpu: int = DEFAULT_MODELS_PER_GPU) -> dict[str, object]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(policy, n, seed, mode, models_per_gpu) for n in mode.grid for seed in mode.seeds for policy in POLICIES]
    print(f"[density] {len(jobs)} simulations ({mode.name}), {workers} at a time", file=sys.stderr, flush=True)
    if workers <= 1:
        results = [_one(job) for job in jobs]
    else:
        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            results = list(pool.map(_one, jobs))
    attainment: dict[str, dict[int, list[float]]] = {p: {n: [] for n in mode.grid} for p in POLICIES}
    p99: dict[str, dict[int, list[float | None]]] = {p: {n: [] for n in mode.grid} for p in POLICIES}
    for policy, n, _, slo, tail in results:  # in the jobs' order: seeds ascending
        attainment[policy][n].append(round(slo, 6))
        p99[policy][n].append(None if tail is None else round(tail, 3))
    figures: dict[str, dict[str, object]] = {}
    for policy in POLICIES:
        best = max_models(attainment[policy], threshold)
        figures[policy] = {"max_models": best, "models_per_accelerator": round(best / mode.accelerators, 3),
                           "slo_attainment": {str(n): v for n, v in attainment[policy].items()},
                           "ttft_p99_s": {str(n): v for n, v in p99[policy].items()}}
    ours = figures[POLICIES[0]]["models_per_accelerator"]
    line: dict[str, object] = {
        "bench": "density", "mode": mode.name, "threshold": threshold, "slo_ttft_s": 5.0,
        "num_nodes": mode.num_nodes, "gpus_per_node": mode.gpus_per_node, "accelerators": mode.accelerators,
        "hours": mode.hours, "grid": list(mode.grid), "seeds": list(mode.seeds), "staged_tier": "dram",
        "models_per_gpu": models_per_gpu,
        "models_per_accelerator": {p: figures[p]["models_per_accelerator"] for p in POLICIES},
        **{f"ratio_to_{p}": (round(ours / figures[p]["models_per_accelerator"], 3)
                             if figures[p]["models_per_accelerator"] else None) for p in PEERS},
        "anchor_models_per_gpu": ANCHOR_MODELS_PER_GPU,
        "ratio_to_anchor": round(ours / ANCHOR_MODELS_PER_GPU, 3),
        "policies": figures}
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 node x 4 GPUs, 15 minutes, 4-16 models, seed 0")
    parser.add_argument("--threshold", type=float, default=0.99, help="the SLO attainment to hold (default 0.99)")
    parser.add_argument("--workers", type=int, default=None, help="simulations side by side (default: CPU cores)")
    parser.add_argument("--models-per-gpu", type=int, default=DEFAULT_MODELS_PER_GPU,
                        help=f"thaw_slot_hosts: the most models one GPU holds (default {DEFAULT_MODELS_PER_GPU})")
    args = parser.parse_args(argv)
    if not 0 < args.threshold <= 1:
        parser.error(f"--threshold must be in (0, 1], got {args.threshold:g}")
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        parser.error(f"--workers must be >= 1, got {workers}")
    if args.models_per_gpu < 1:
        parser.error(f"--models-per-gpu must be >= 1, got {args.models_per_gpu}")
    print(json.dumps(run(QUICK if args.quick else FULL, args.threshold, workers, args.models_per_gpu)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
