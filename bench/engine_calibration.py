"""The real engine's costs for a simulator profile (`bench/sim_fidelity.py`): one model's prefill
seconds per prompt length and decode-step seconds per batch size, at a worker's thread count, and
the straight line through them.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.multimodel_setup import THREADS_PER_INSTANCE

__all__ = ["calibrate_engine", "line_fit"]

CALIBRATION_REPEATS = 3
DECODE_BATCHES = (1, 4)
NUM_DECODE_STEPS = 8


def calibrate_engine(path: Path, prompt_lengths: list[int], seed: int) -> dict[str, Any]:
    """One model in the real engine at the workers' thread count: prefill seconds per prompt
    length and decode-step seconds per batch size (medians of `CALIBRATION_REPEATS`)."""
    import torch

    from worker import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(THREADS_PER_INSTANCE)
    engine = Engine(path, EngineConfig(cpu_prepack_defer_bytes=None))  # steps timed packed, as they run warm
    rng = random.Random(f"{seed}/calibration/{path.name}")

    def params(max_tokens: int) -> Any:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(length)]  # fresh ids: no prefix-cache hit

    def finish_all() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    engine.add_request(prompt(16), params(4))  # first-call costs (kernels, oneDNN primitives)
    finish_all()
    prefill = {}
    for length in prompt_lengths:
        samples = []
        for _ in range(CALIBRATION_REPEATS):
            engine.add_request(prompt(length), params(1))
            t0 = time.perf_counter()
            finish_all()  # one step: the prefill and its one token
            samples.append(time.perf_counter() - t0)
        prefill[length] = statistics.median(samples)
    decode = {}
    for batch in DECODE_BATCHES:
        samples = []
        for _ in range(CALIBRATION_REPEATS):
            for _ in range(batch):
                engine.add_request(prompt(16), params(NUM_DECODE_STEPS + 2))
            engine.step()  # the batch's prefills, together (chunked prefill)
            t0 = time.perf_counter()
            for _ in range(NUM_DECODE_STEPS):
                engine.step()
            samples.append((time.perf_counter() - t0) / NUM_DECODE_STEPS)
            finish_all()
        decode[batch] = statistics.median(samples)
    return {"prefill_s": prefill, "decode_step_s": decode}


def line_fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clipped at 0."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var) if var else 0.0
    return max(0.0, mean_y - slope * mean_x), slope
