"""The report: a TTFT CDF of a day's millions of requests is drawn through a few thousand ranks."""

import dataclasses
import math

import numpy as np

from sim import report
from sim.simulator import SimResult


def _result(ttft: np.ndarray) -> SimResult:
    return SimResult(policy="thaw", num_requests=len(ttft), num_served=int((~np.isnan(ttft)).sum()),
                     ttft_p50_s=1.0, ttft_p99_s=math.inf, slo_ttft_s=5.0, slo_attainment=0.5, accelerator_s=1.0,
                     cold_starts=0, cold_starts_by_tier={}, migrations=0, evictions=0, preemptions=0,
                     decision_ms_p50=None, decision_ms_p99=None, num_ticks=0, sim_end_s=1.0, wall_s=0.0,
                     num_events=0, ttft_s=ttft, accelerators_in_use=((0.0, 1), (60.0, 2)))


def test_a_long_cdf_is_drawn_through_cdf_points_ranks_ending_at_the_last(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    original = matplotlib.axes.Axes.plot

    def plot(self, x, y, *args, **kwargs):
        drawn.append((np.asarray(x), np.asarray(y)))
        return original(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    ttft = np.arange(1, 10_001, dtype=np.float64) / 1000  # 1 ms .. 10 s, sorted
    ttft[::10] = np.nan  # a tenth never served: the curve ends at 0.9
    paths = report.write_report([_result(ttft)], tmp_path)
    x, y = drawn[0]  # the CDF (the accelerators plot follows)
    assert len(x) == report.CDF_POINTS
    assert x[0] == 0.002 and x[-1] == 10.0 and y[-1] == 0.9  # the first and last served requests
    assert np.all(np.diff(x) > 0) and np.all(np.diff(y) > 0)
    assert paths["ttft_cdf"].read_bytes()[:4] == b"\x89PNG"


def test_the_table_shows_the_p99_floor_and_a_dash_without_one():
    with_floor = dataclasses.replace(_result(np.array([1.0, 2.0])), ttft_p99_floor_s=43.845714)
    table = report.format_table([with_floor, _result(np.array([1.0]))]).splitlines()
    assert "P99 floor" in table[0]
    assert "43.846" in table[1]
    assert table[2].split()[3] == "-"
