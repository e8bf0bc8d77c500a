"""The first-load floor of a run's TTFT: what no policy that loads on demand can beat.

A model's first instance cannot be ready before its first request arrives and its checkpoint is
read from the fastest place the run starts with it (the repository, or a tier staged before the
run) and its engine started: `first_arrival_s + floor_load_s`. Every request of the model that
arrives before then waits at least the rest of that time, under any policy that starts instances
when demand comes (a peer stream needs a running peer, a wake a slept instance: both come after
a first load). So for request i of model m

    floor_i = max(0, first_arrival_s[m] + floor_load_s[m] - arrival_s[i])

is a lower bound of its TTFT, and the P99 of the floors a lower bound of the run's P99 (a
percentile of pointwise larger values is no smaller). It ignores queueing behind other loads,
compute and the read path's sharing, so a policy's P99 above it is time its decisions (or the
cluster's size) cost; a P99 equal to it is the repository's bandwidth, which no scheduling moves.
The unbounded reference cluster is exempt: it starts every instance resident.
"""

from __future__ import annotations

import numpy as np

__all__ = ["first_load_floor_s", "percentile_floor_s"]


def first_load_floor_s(arrival_s: np.ndarray, model_index: np.ndarray, floor_load_s: np.ndarray) -> np.ndarray:
    """Each request's TTFT floor (see the module docstring). `arrival_s` [R] in any order,
    `model_index` [R] into `floor_load_s` [M] (seconds from a model's first request to its first
    instance at the earliest). Returns [R] seconds >= 0."""
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    model_index = np.asarray(model_index, dtype=np.int64)
    floor_load_s = np.asarray(floor_load_s, dtype=np.float64)
    if arrival_s.shape != model_index.shape or arrival_s.ndim != 1:
        raise ValueError(f"arrival_s and model_index must be 1-d and alike, got {arrival_s.shape} and {model_index.shape}")
    if len(model_index) and (model_index.min() < 0 or model_index.max() >= len(floor_load_s)):
        raise ValueError(f"model_index must index floor_load_s's {len(floor_load_s)} models")
    if np.any(~np.isfinite(floor_load_s)) or np.any(floor_load_s < 0):
        raise ValueError("floor_load_s must be finite seconds >= 0")
    first = np.full(len(floor_load_s), np.inf)
    np.minimum.at(first, model_index, arrival_s)  # [M] each model's first arrival (inf: none)
    floor = first[model_index] + floor_load_s[model_index] - arrival_s  # [R]
    return np.maximum(floor, 0.0)


def percentile_floor_s(floor_s: np.ndarray, q: float) -> float:
    """The q-th percentile of the floors, ranked as the run's own percentiles are
    (`method="higher"`), so the two compare rank for rank; NaN for no requests."""
    return float(np.percentile(floor_s, q, method="higher")) if len(floor_s) else float("nan")
