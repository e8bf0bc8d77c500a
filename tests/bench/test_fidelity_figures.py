"""bench/fidelity_figures.py (what bench/sim_fidelity.py compares), with numbers: which of two
policies is better per figure on each side, ties within 20%, whether the simulator agrees with the
real platform, and SLO attainment from per-request TTFTs."""

from __future__ import annotations

import pytest

from bench.fidelity_figures import figures_of, ranking


def side(slo: float, p50: float, p99: float) -> dict[str, float]:
    return {"slo_attainment": slo, "ttft_p50_s": p50, "ttft_p99_s": p99}


def test_the_simulator_agrees_when_it_orders_each_figure_as_the_real_platform():
    result = ranking({"thaw": {"real": side(0.95, 0.1, 8.0), "sim": side(0.97, 0.12, 7.0)},
                      "keepalive": {"real": side(0.60, 5.0, 65.0), "sim": side(0.70, 4.0, 65.0)}})
    slo, p50, p99 = (result["by_figure"][f]["pairs"][0] for f in ("slo_attainment", "ttft_p50_s", "ttft_p99_s"))
    assert (slo["real"], slo["sim"]) == (1, 1)  # higher attainment is better
    assert (p50["real"], p50["sim"]) == (1, 1)  # lower TTFT is better
    assert (p99["real"], p99["sim"]) == (1, 1)
    assert result["all_agree"] is True


def test_a_tie_on_one_side_only_disagrees():
    """Real P99s 10 and 11.5 s are within 20% (a tie); simulated 5 and 11.5 s are not."""
    result = ranking({"a": {"real": side(0.9, 1.0, 10.0), "sim": side(0.9, 1.0, 5.0)},
                      "b": {"real": side(0.9, 1.0, 11.5), "sim": side(0.9, 1.0, 11.5)}})
    p99 = result["by_figure"]["ttft_p99_s"]
    assert (p99["pairs"][0]["real"], p99["pairs"][0]["sim"]) == (0, 1) and p99["agrees"] is False
    assert result["by_figure"]["slo_attainment"]["agrees"] is True  # equal on both sides: a tie each
    assert result["all_agree"] is False


def test_the_opposite_order_disagrees():
    result = ranking({"a": {"real": side(0.5, 1.0, 10.0), "sim": side(0.9, 1.0, 10.0)},
                      "b": {"real": side(0.9, 1.0, 10.0), "sim": side(0.5, 1.0, 10.0)}})
    slo = result["by_figure"]["slo_attainment"]["pairs"][0]
    assert (slo["real"], slo["sim"], slo["agrees"]) == (-1, 1, False)


def test_slo_attainment_counts_first_tokens_within_the_slo_and_never_a_censored_one():
    ttfts = [(0.5, False), (5.0, False), (5.1, False), (65.0, True)]
    figures = figures_of(ttfts, {"dram": 1, "repository": 2}, slo_s=5.0)
    assert figures["slo_attainment"] == pytest.approx(0.5)
    assert figures_of([(3.0, True)], {}, slo_s=5.0)["slo_attainment"] == 0.0  # censored below the SLO: a miss
    assert figures["cold_starts"] == 3 and figures["cold_starts_repository"] == 2
