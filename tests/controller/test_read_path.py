"""A new load's wait on a node's read path under the store's order (`controller.read_path`), with
numbers, and placement using it: a short load is not charged a long download it would pass."""

from __future__ import annotations

import pytest

from controller.placement_policy import NodeView, TierBandwidths, estimate_node, place
from controller.read_path import first_passed, read_path_wait_s

GB = 10**9


def test_in_arrival_order_a_load_waits_for_every_load_ahead():
    assert read_path_wait_s(2.0, (400.0, 30.0), 0.0) == 430.0
    assert read_path_wait_s(2.0, (), 8.0) == 0.0


def test_a_short_load_passes_the_first_load_r_times_longer_and_every_one_after_it():
    # In flight 200 s, then 10 s and 300 s waiting; ratio 8.
    loads = (200.0, 10.0, 300.0)
    assert read_path_wait_s(2.0, loads, 8.0) == 0.0  # 16 <= 200: it pauses the one in flight
    assert read_path_wait_s(60.0, loads, 8.0) == 510.0  # 480 > every load: it waits for all
    assert read_path_wait_s(30.0, loads, 8.0) == 200.0 + 10.0  # 240 <= 300: ahead of the last one only
    assert read_path_wait_s(50.0, (400.0,), 8.0) == 0.0  # equal to r times: it passes (as the store)


def test_a_node_view_sums_its_loads_and_refuses_bad_ones():
    rates = TierBandwidths(repository_bytes_per_s=1 * GB)
    view = NodeView(node_id="n", num_free_slots=1, bandwidths=rates, loader_loads_s=(400.0, 10.0), short_fetch_ratio=8)
    assert view.loader_wait_s == 410.0 and view.read_path_wait_s(2.0) == 0.0 and view.read_path_wait_s(100.0) == 410.0
    assert NodeView(node_id="n", num_free_slots=1, bandwidths=rates, loader_loads_s=[7.0]).read_path_wait_s(0.1) == 7.0
    with pytest.raises(ValueError, match="loader_loads_s must be finite seconds >= 0"):
        NodeView(node_id="n", num_free_slots=1, bandwidths=rates, loader_loads_s=(-1.0,))
    with pytest.raises(ValueError, match=r"node n: short_fetch_ratio must be 0 \(arrival order\) or a number >= 1"):
        NodeView(node_id="n", num_free_slots=1, bandwidths=rates, short_fetch_ratio=0.5)


def test_the_first_load_passed_is_what_the_simulators_read_path_queues_by():
    assert first_passed(2.0, (200.0, 10.0, 300.0), 8.0) == 0
    assert first_passed(30.0, (200.0, 10.0, 300.0), 8.0) == 2
    assert first_passed(60.0, (200.0, 10.0, 300.0), 8.0) is None
    assert first_passed(2.0, (200.0,), 0.0) is None  # arrival order: it passes none


def test_a_small_models_start_goes_to_the_node_busy_with_a_long_download_when_it_passes_it():
    """Node `busy` fetches a 140 GB model (280 s left at 0.5 GB/s); node `slow` is idle but its
    repository path is half as fast. A 1 GB model (2 s on `busy`) passes the long download there:
    2 s against 4 s. In arrival order it would wait 282 s there and go to `slow`."""
    fast, half = TierBandwidths(repository_bytes_per_s=0.5 * GB), TierBandwidths(repository_bytes_per_s=0.25 * GB)
    for ratio, expected in ((8.0, "busy"), (0.0, "slow")):
        nodes = [NodeView(node_id="busy", num_free_slots=1, bandwidths=fast, loader_loads_s=(280.0,),
                          short_fetch_ratio=ratio),
                 NodeView(node_id="slow", num_free_slots=1, bandwidths=half)]
        decision = place(1 * GB, nodes)
        assert decision.node_id == expected, decision.reason
    assert estimate_node(1 * GB, nodes[0]).wait_s == 280.0  # ratio 0: the whole download
