"""A node's read path: one load at a time (the node store's queue) or shared evenly, with exact ends."""

import dataclasses
import math

import pytest

from sim.cluster_spec import ClusterSpec
from sim.cost_model import H100, default_cost_model
from sim.event_loop import EventLoop
from sim.node_loader import QueuedLoader, SharedLoader, ShortFirstLoader, join, node_loader
from sim.policies import PolicySettings
from sim.policy_factory import make_policy
from sim.sim_cluster import SimCluster
from sim.sim_models import SimModel
from sim.simulator import SimConfig
from sim.tick_scheduler import TickScheduler
from storage.store_config import NodeStoreConfig

COST = default_cost_model()


def _ends(loop, loader, starts):
    """Start each (at_s, work_s) and return each load's end time."""
    ends = [None] * len(starts)

    def begin(i, work_s):
        job = loader.start(work_s)
        if job.delay_s is not None:
            ends[i] = job.end_s
        else:
            join(job, lambda: ends.__setitem__(i, loop.now))

    for i, (at_s, work_s) in enumerate(starts):
        loop.schedule(at_s, begin, i, work_s)
    loop.run(until_s=1e6)
    return ends


def test_a_queue_ends_each_load_after_the_ones_before_it():
    loop = EventLoop()
    loader = QueuedLoader(loop)
    assert _ends(loop, loader, [(0.0, 10.0), (1.0, 1.0), (20.0, 2.0)]) == [10.0, 11.0, 22.0]
    assert loader.backlog_s(21.0) == 1.0 and loader.backlog_s(30.0) == 0.0


def test_a_load_eight_times_shorter_pauses_the_one_in_flight_which_goes_on_where_it_stopped():
    loop = EventLoop()
    loader = ShortFirstLoader(loop, 8.0)
    # 400 s in flight from 0; at 100 s a 3 s load (300 s left >= 8 x 3) goes first, 100..103, and
    # the long one ends at 403; a 50 s load at 110 s is not 8x shorter than the 297 s left
    # (8 x 50 = 400): it waits its turn and ends at 453.
    assert _ends(loop, loader, [(0.0, 400.0), (100.0, 3.0), (110.0, 50.0)]) == [403.0, 103.0, 453.0]


def test_a_short_load_goes_ahead_of_a_long_waiting_one_not_of_a_short_one():
    loop = EventLoop()
    loader = ShortFirstLoader(loop, 8.0)
    # in flight: 10 s from 0 (9 s left at 1: a 2 s load is not 8x shorter); waiting: 100 s (at 1),
    # then 2 s (at 2) goes ahead of the 100 s one, 1.5 s (at 3) not ahead of the 2 s one
    ends = _ends(loop, loader, [(0.0, 10.0), (1.0, 100.0), (2.0, 2.0), (3.0, 1.5)])
    assert ends == [10.0, 113.5, 12.0, 13.5]
    assert loader.backlog_s(0.0) == 0.0


def test_without_a_short_load_the_order_is_the_queues():
    starts = [(0.0, 10.0), (1.0, 5.0), (2.0, 7.0), (30.0, 1.0)]
    loop = EventLoop()
    queued = _ends(loop, QueuedLoader(loop), starts)
    loop = EventLoop()
    assert _ends(loop, ShortFirstLoader(loop, 8.0), starts) == queued == [10.0, 15.0, 22.0, 31.0]


def test_shared_loads_move_at_an_even_share_so_a_small_one_ends_first():
    loop = EventLoop()
    # 10 s and 1 s from t=0: both at half rate; the 1 s one ends at 2 s, the other has 9 s left alone.
    assert _ends(loop, SharedLoader(loop, 4), [(0.0, 10.0), (0.0, 1.0)]) == pytest.approx([11.0, 2.0])
    loop = EventLoop()
    # Two equal loads end together, at the sum of their work: the path is busy at full rate throughout.
    assert _ends(loop, SharedLoader(loop, 4), [(0.0, 5.0), (0.0, 5.0)]) == pytest.approx([10.0, 10.0])
    loop = EventLoop()
    # A load joining at 4 s: the first has 6 s left, shared for 2 x 3 s, then 3 s alone.
    assert _ends(loop, SharedLoader(loop, 4), [(0.0, 10.0), (4.0, 3.0)]) == pytest.approx([13.0, 10.0])


def test_past_its_bound_a_shared_loader_queues_in_arrival_order():
    loop = EventLoop()
    loader = SharedLoader(loop, 2)
    ends = _ends(loop, loader, [(0.0, 4.0), (0.0, 4.0), (0.0, 1.0)])
    assert ends == pytest.approx([8.0, 8.0, 9.0])  # the third waits for a place, then runs alone


def test_the_backlog_is_the_work_left_under_either_discipline():
    loop = EventLoop()
    shared = SharedLoader(loop, 2)
    for work_s in (4.0, 6.0, 3.0):  # the third waits
        shared.start(work_s)
    assert shared.backlog_s(0.0) == 13.0
    assert shared.backlog_s(5.0) == 8.0
    assert QueuedLoader(loop).backlog_s(0.0) == 0.0 and SharedLoader(loop, 2).backlog_s(0.0) == 0.0


def test_bad_loads_and_bounds_are_refused():
    loop = EventLoop()
    for bad in (-1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="a load's work must be a finite number of seconds >= 0"):
            QueuedLoader(loop).start(bad)
        with pytest.raises(ValueError, match="a load's work must be a finite number of seconds >= 0"):
            SharedLoader(loop, 2).start(bad)
    with pytest.raises(ValueError, match="ratio >= 1 times shorter"):
        ShortFirstLoader(loop, 0.5)
    with pytest.raises(ValueError, match="ClusterSpec.short_fetch_ratio must be 0"):
        ClusterSpec(num_nodes=1, gpus_per_node=1, short_fetch_ratio=0.5)
    with pytest.raises(ValueError, match="a shared loader takes 2 or more loads at once"):
        SharedLoader(loop, 1)
    with pytest.raises(ValueError, match="a queued load's end is known at its start"):
        join(QueuedLoader(loop).start(1.0), lambda: None)
    assert isinstance(node_loader(loop, 1, 0.0), QueuedLoader) and isinstance(node_loader(loop, 3, 0.0), SharedLoader)
    assert isinstance(node_loader(loop, 1, 8.0), ShortFirstLoader) and isinstance(node_loader(loop, 3, 8.0), SharedLoader)
    with pytest.raises(ValueError, match="ClusterSpec.concurrent_loads must be an integer >= 1, got 0"):
        ClusterSpec(num_nodes=1, gpus_per_node=1, concurrent_loads=0)


def test_the_simulators_read_path_defaults_to_the_node_stores_order():
    """The simulator models the store: both let a fetch 8 times shorter go first by default."""
    store_default = next(f.default for f in dataclasses.fields(NodeStoreConfig) if f.name == "short_fetch_ratio")
    assert store_default == 8
    assert ClusterSpec(num_nodes=1, gpus_per_node=1).short_fetch_ratio == store_default
    assert SimConfig(num_models=1, num_nodes=1).short_fetch_ratio == store_default


def _cold_starts(concurrent_loads, sizes, short_fetch_ratio=0.0):
    """Each model's first start from the repository on one node at t=0; each instance's ready time."""
    models = [SimModel(model_id=f"m{i}", family="llama", params_b=b / 2e9, weight_bytes=b) for i, b in enumerate(sizes)]
    loop = EventLoop()
    spec = ClusterSpec(num_nodes=1, gpus_per_node=len(sizes) + 1, start_overhead_s=1.5, concurrent_loads=concurrent_loads,
                       short_fetch_ratio=short_fetch_ratio)
    cluster = SimCluster(spec, models, COST, H100, loop)
    policy = make_policy("serverlessllm", PolicySettings())  # keeps node copies: the store's single flight
    cluster.attach(policy)
    policy.attach(cluster, TickScheduler(loop, 1.0, policy.tick))
    instances = [cluster.start_instance(i, 0, "s3") for i in range(len(sizes))]
    second = cluster.start_instance(0, 0, "s3")  # the same model again: waits for the fetch in flight
    loop.run(until_s=1e5)
    return [i.ready_s for i in instances], second.ready_s


@pytest.mark.parametrize("concurrent_loads, short_fetch_ratio", [(1, 0.0), (4, 0.0), (1, 4.0)])
def test_the_cluster_starts_an_instance_when_its_fetch_ends_plus_its_engine_start(concurrent_loads,
                                                                                 short_fetch_ratio):
    big, small = 8_000_000_000, 1_000_000_000
    ready, second = _cold_starts(concurrent_loads, [big, small], short_fetch_ratio)
    big_s, small_s = COST.load_s(big, "s3"), COST.load_s(small, "s3")
    assert big_s >= 4 * small_s
    if short_fetch_ratio:  # the small one pauses the big one and goes first
        assert ready == pytest.approx([big_s + small_s + 1.5, small_s + 1.5])
    elif concurrent_loads == 1:  # in arrival order: the small one after the big one
        assert ready == pytest.approx([big_s + 1.5, big_s + small_s + 1.5])
    else:  # shared: the small one ends at twice its own time, the big one at the sum
        assert ready == pytest.approx([big_s + small_s + 1.5, 2 * small_s + 1.5])
    assert second == pytest.approx(ready[0])  # one fetch, two instances
