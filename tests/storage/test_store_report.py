"""Reports as placement uses them: load-time estimates per tier and the best tier of a model."""

import pytest

from storage import BandwidthReport, NodeStoreReport, TierEntryReport, TierReport

GB = 10**9


def tier(name, *models, filling=()):
    entries = tuple(TierEntryReport(model=m, num_bytes=GB, last_used_s=float(i), pinned=False, num_loading=0,
                                    filling=m in filling) for i, m in enumerate(models))
    return TierReport(tier=name, path=f"/{name}", capacity_bytes=10 * GB, used_bytes=len(models) * GB,
                      entries=entries)


def report(bandwidth, dram=(), ssd=(), filling=()):
    return NodeStoreReport(platform_id="p", node_id="n", tiers=(tier("dram", *dram, filling=filling),
                                                                tier("ssd", *ssd)),
                           bandwidth=bandwidth, num_fetches=0, num_conversions=0, reported_at=0.0)


def test_load_seconds_per_source():
    bw = BandwidthReport(ssd_bytes_per_s=2 * GB, dram_bytes_per_s=10 * GB, repository_bytes_per_s=0.5 * GB,
                         measured_at=0.0)
    assert bw.load_s("dram", 5 * GB) == pytest.approx(0.5)
    assert bw.load_s("ssd", 5 * GB) == pytest.approx(2.5)
    assert bw.load_s("repository", 5 * GB) == pytest.approx(10 + 2.5)  # download, then read from the SSD
    assert bw.rate("repository") == pytest.approx(0.4 * GB)
    with pytest.raises(ValueError, match="source 'gpu'"):
        bw.load_s("gpu", 1)


def test_unknown_bandwidth_gives_no_estimate():
    bw = BandwidthReport(ssd_bytes_per_s=2 * GB, dram_bytes_per_s=None, repository_bytes_per_s=None, measured_at=0)
    assert bw.load_s("dram", GB) is None and bw.load_s("repository", GB) is None
    assert bw.load_s("ssd", GB) == pytest.approx(0.5)


def test_best_tier_and_estimate():
    bw = BandwidthReport(ssd_bytes_per_s=2 * GB, dram_bytes_per_s=10 * GB, repository_bytes_per_s=1 * GB,
                         measured_at=0)
    r = report(bw, dram=("hot", "arriving"), ssd=("hot", "warm", "arriving"), filling=("arriving",))
    assert r.tier("dram").models == ("hot",) and r.tier("ssd").models == ("hot", "warm", "arriving")
    assert [r.best_tier(m) for m in ("hot", "warm", "arriving", "cold")] == ["dram", "ssd", "ssd", None]
    assert r.estimate_load_s("hot", GB) == pytest.approx(0.1)
    assert r.estimate_load_s("cold", GB) == pytest.approx(1.5)
    assert r.tier("dram").get("hot").loading is False and r.tier("dram").free_bytes == 8 * GB
    with pytest.raises(KeyError):
        r.tier("gpu")
