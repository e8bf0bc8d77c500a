"""What a comparison run prints and writes: one JSON line per policy, a table, and two PNG plots.

`result_line(result)` is the JSON object of one policy (keys `policy`, `ttft_p50_s`, `ttft_p99_s`,
`ttft_p99_floor_s` (`sim.ttft_floor`), `slo_attainment`, `accelerator_s`, `cold_starts`,
`cold_starts_by_tier`, `migrations`, `evictions`, `decision_ms_p50`, ...; a percentile that is infinite -- requests never served -- is null).
`write_report(results, out_dir)` writes `results.jsonl` and, next to it, `ttft_cdf.png` (the TTFT
CDF of each policy, log-scaled seconds) and `accelerators.png` (accelerators in use over time).
matplotlib is imported only there, with the non-interactive Agg backend. A CDF of more than
`CDF_POINTS` requests is drawn through that many evenly spaced ranks (first and last included).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["format_table", "result_line", "write_report"]

CDF_POINTS = 4000  # ranks drawn per TTFT curve (all of them below that)


def result_line(result) -> str:
    """One policy's figures as one JSON line."""
    return json.dumps(result.summary(), sort_keys=False)


def format_table(results: Sequence) -> str:
    """A fixed-width table of the headline figures, one row per policy. "P99 floor" is the P99 no
    policy that loads on demand can beat (`sim.ttft_floor`; "-" for the unbounded reference)."""
    header = (f"{'policy':<14} {'P50 TTFT s':>11} {'P99 TTFT s':>11} {'P99 floor':>10} {'SLO':>7} {'accel-h':>10} {'cold':>7} "
              f"{'migr':>6} {'evict':>6} {'tick ms p50':>11}")
    rows = [header]
    for r in results:
        s = r.summary()

        def num(x, fmt):
            return format("-" if s["num_ticks"] == 0 else "inf", f">{fmt[:2]}") if x is None else format(x, fmt)

        floor = "-" if s["ttft_p99_floor_s"] is None else format(s["ttft_p99_floor_s"], "10.3f")
        rows.append(f"{s['policy']:<14} {num(s['ttft_p50_s'], '11.3f')} {num(s['ttft_p99_s'], '11.3f')} {floor:>10} "
                    f"{s['slo_attainment']:7.3f} {s['accelerator_s'] / 3600:10.1f} {s['cold_starts']:7d} "
                    f"{s['migrations']:6d} {s['evictions']:6d} {num(s['decision_ms_p50'], '11.3f')}")
    return "\n".join(rows)


def write_report(results: Sequence, out_dir: Path) -> dict[str, Path]:
    """Writes results.jsonl, ttft_cdf.png and accelerators.png into `out_dir` (created); returns
    their paths by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.jsonl", "ttft_cdf": out_dir / "ttft_cdf.png",
             "accelerators": out_dir / "accelerators.png"}
    paths["json"].write_text("".join(result_line(r) + "\n" for r in results))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ttft = np.sort(r.ttft_s[~np.isnan(r.ttft_s)])
        if len(ttft):
            ranks = np.arange(1, len(ttft) + 1)
            if len(ttft) > CDF_POINTS:  # a day is millions of requests: the curve at CDF_POINTS ranks
                ranks = np.unique(np.linspace(1, len(ttft), CDF_POINTS).round().astype(np.int64))
            frac = ranks / r.num_requests  # unserved requests keep the CDF below 1
            ax.plot(np.maximum(ttft[ranks - 1], 1e-4), frac, label=r.policy)
    if results:
        ax.axvline(results[0].slo_ttft_s, color="grey", linestyle=":", label=f"SLO {results[0].slo_ttft_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["ttft_cdf"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r.accelerators_in_use:
            t, used = zip(*r.accelerators_in_use)
            ax.step(np.array(t) / 3600, used, where="post", label=r.policy)
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("accelerators held")
    ax.set_title("Accelerators in use over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["accelerators"], dpi=120)
    plt.close(fig)
    return paths
