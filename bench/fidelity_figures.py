"""What `bench/sim_fidelity.py` compares between the real platform and the simulator: each side's
figures from per-request TTFTs and cold starts, sim / real per figure within `TOLERANCE`, and
whether the simulator ranks two policies as the real platform does.
"""

from __future__ import annotations

import math
from typing import Any

from bench.trace_client import censored_percentile

__all__ = ["FIGURES", "RANKED", "TOLERANCE", "compare", "figures_of", "ranking", "sim_ttfts"]

TOLERANCE = 0.20
FIGURES = ("slo_attainment", "ttft_p50_s", "ttft_p99_s", "cold_starts", "cold_starts_dram", "cold_starts_ssd",
           "cold_starts_repository")
RANKED = {"slo_attainment": True, "ttft_p50_s": False, "ttft_p99_s": False}  # figure -> higher is better


def figures_of(ttfts: list[tuple[float, bool]], by_tier: dict[str, int], slo_s: float) -> dict[str, Any]:
    """The compared figures of one side: SLO attainment (the share of requests whose first token
    came within `slo_s`, the models' TTFT SLO; a censored one never does), TTFT percentiles, cold
    starts by tier."""
    return {"slo_attainment": round(sum(1 for t, censored in ttfts if not censored and t <= slo_s) / len(ttfts), 4)
            if ttfts else 0.0,
            "ttft_p50_s": round(censored_percentile(ttfts, 50)[0], 4),
            "ttft_p99_s": round(censored_percentile(ttfts, 99)[0], 4),
            "ttft_p99_censored": censored_percentile(ttfts, 99)[1],
            "cold_starts": sum(by_tier.values()),
            **{f"cold_starts_{tier}": by_tier.get(tier, 0) for tier in ("dram", "ssd", "repository")},
            "cold_starts_other": sum(n for tier, n in by_tier.items() if tier not in ("dram", "ssd", "repository"))}


def compare(real: dict[str, Any], simulated: dict[str, Any]) -> tuple[dict[str, float | None], dict[str, bool]]:
    """sim / real per figure, and whether it is within `TOLERANCE` (two zeros agree; a zero
    against anything else does not)."""
    ratios, within = {}, {}
    for name in FIGURES:
        r, s = real[name], simulated[name]
        ratios[name] = round(s / r, 4) if r else None
        within[name] = abs(s - r) <= TOLERANCE * r if r else s == 0
    return ratios, within


def sim_ttfts(result: Any, deadline_s: float) -> list[tuple[float, bool]]:
    """Per request: its simulated TTFT, capped at the client's deadline (then censored)."""
    out = []
    for ttft in result.ttft_s.tolist():
        if math.isnan(ttft) or ttft >= deadline_s:
            out.append((deadline_s, True))
        else:
            out.append((ttft, False))
    return out


def ranking(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whether the simulator orders the policies as the real platform does, per `RANKED` figure:
    for each pair, which is better on each side. Values within `TOLERANCE` of each other are a tie
    (one side's tie agrees only with the other's tie), so noise between two equal policies is not
    read as a ranking."""
    def order(a: float, b: float, higher_better: bool) -> int:
        if abs(a - b) <= TOLERANCE * max(abs(a), abs(b)):
            return 0
        return (1 if a > b else -1) * (1 if higher_better else -1)

    names = list(sides)
    figures: dict[str, Any] = {}
    for figure, higher_better in RANKED.items():
        pairs = []
        for i, first in enumerate(names):
            for second in names[i + 1:]:
                real = order(sides[first]["real"][figure], sides[second]["real"][figure], higher_better)
                simulated = order(sides[first]["sim"][figure], sides[second]["sim"][figure], higher_better)
                pairs.append({"pair": [first, second], "real": real, "sim": simulated, "agrees": real == simulated})
        figures[figure] = {"pairs": pairs, "agrees": all(p["agrees"] for p in pairs)}
    return {"by_figure": figures, "all_agree": all(f["agrees"] for f in figures.values()),
            "note": "per pair: 1 the first policy is better, -1 the second, 0 within 20% of each other"}
