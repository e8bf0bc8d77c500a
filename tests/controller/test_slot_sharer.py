"""Slots shared on demand, in the controller (fake cluster, fake clock): an idle instance evicted for
a waiting model, the evicted model's count and DRAM copy, preemption by suspension after the
bound, priorities, the order waiting models get slots in, and the outlook a gateway is told.
See `controller.slot_sharer`; the pure policies have their own tests."""

from __future__ import annotations

import asyncio

import pytest

from controller.eviction_policy import EvictionSettings
from controller.slot_outlook import SlotOutlook
from controller.slot_sharing_settings import SlotSharingSettings
from tests.controller.test_controller import MODEL_BYTES, NODE, REPOSITORY_S, SSD_S, Harness, eventually, spec


async def deploy(h: Harness, name: str, seed: int, **autoscaling) -> str:
    model_id = f"acme/{name}"
    h.cluster.model_bytes[f"acme--{name}"] = MODEL_BYTES
    await h.controller.deploy(spec(model_id, h.source(name, seed), **autoscaling))
    return model_id


def kinds(h: Harness, kind: str) -> list[dict]:
    return [d for d in h.controller.status()["recent_decisions"] if d["kind"] == kind]


def test_an_idle_instance_gives_its_slot_to_a_waiting_model_at_once(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1) as h:
            a = await deploy(h, "a", 1, keep_alive_s=60.0)
            b = await deploy(h, "b", 2, keep_alive_s=60.0)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [a_worker] = h.cluster.live_workers()
            h.controller.notify_demand(a, 0)  # its request was served; a idles, well inside its keep-alive
            await h.tick(1.0)
            assert h.routes(a) == [a_worker.instance_id]

            outlook = h.controller.notify_demand(b, 1, "gw", 0.2)
            assert isinstance(outlook, SlotOutlook) and outlook.status == "waiting_for_slot"
            assert outlook.position == 1 and [x.model_id for x in outlook.holders] == [a]
            await h.tick()
            [eviction] = kinds(h, "eviction")
            assert (eviction["model_id"], eviction["instance_id"], eviction["victim_model_id"]) == (
                b, a_worker.instance_id, a)
            # A never served a request the controller counted: frequency floor 0.1 x reload from DRAM
            # (the node's DRAM tier can take it): the start overhead measured on a's own start (the
            # fake's 0.5 s load beyond its repository estimate) + the read at the fallback 8 GB/s.
            assert eviction["score"] == pytest.approx(0.1 * ((0.5 - REPOSITORY_S) + MODEL_BYTES / 8e9))
            assert eviction["reason"].startswith(f"evict idle {a_worker.instance_id} ({a}, priority 0, idle 1.0s)")
            assert h.routes(a) == []  # out of routing at once
            a_state = h.controller.get_model(a)
            assert a_state["num_desired_instances"] == 0  # evicted: it does not come back without demand
            # While the victim stops the slot is held for b, and b's gateway hears so.
            outlook = h.controller.notify_demand(b, 1, "gw", 0.3)
            assert outlook.status in ("waiting_for_slot", "loading", "ready")
            await eventually(lambda: h.cluster.stopped_workers == [a_worker.instance_id], "the evicted worker stopped")
            h.controller.notify_demand(b, 1, "gw", 0.4)
            await h.tick()
            assert len(h.routes(b)) == 1 and h.routes(a) == []
            assert h.controller.notify_demand(b, 0).status == "ready"
            assert h.controller.status()["slot_sharing"]["counts"]["evictions"] == 1

    asyncio.run(scenario())


def test_an_instance_at_min_instances_is_never_evicted(tmp_path):
    bounded = SlotSharingSettings(deadline_preemption=False)  # preemption after the bound, as before deadlines

    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=bounded) as h:
            a = await deploy(h, "a", 1, min_instances=1)
            b = await deploy(h, "b", 2)
            await h.tick()
            [a_worker] = h.cluster.live_workers()
            await h.tick(5.0)
            h.controller.notify_demand(b, 1, "gw", 0.0)
            await h.tick()
            assert kinds(h, "eviction") == [] and h.routes(a) == [a_worker.instance_id]
            reason = h.controller.get_model(b)["last_placement"]["reason"]
            assert f"{a_worker.instance_id} ({a}): its model is at min_instances 1" in reason

    asyncio.run(scenario())


def test_the_evicted_checkpoint_read_from_ssd_is_copied_into_dram(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, spare_refill_delay_s=0.0) as h:
            a = await deploy(h, "a", 1)
            b = await deploy(h, "b", 2)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [a_worker] = h.cluster.live_workers()
            assert h.controller.get_model(a)["instances"][0]["tier"] == "ssd"
            h.cluster.stores[NODE].prefetches.clear()
            h.controller.notify_demand(a, 0)
            h.controller.notify_demand(b, 1, "gw", 0.0)
            await h.tick(1.0)
            assert [d["instance_id"] for d in kinds(h, "eviction")] == [a_worker.instance_id]
            await eventually(lambda: h.cluster.stopped_workers == [a_worker.instance_id], "the evicted worker stopped")
            h.controller.notify_demand(b, 1, "gw", 1.0)
            await h.tick()
            await h.tick()
            assert ("acme--a", "dram") in h.cluster.stores[NODE].prefetches

    asyncio.run(scenario())


def test_a_busy_model_is_suspended_after_the_bound_and_resumes_in_turn(tmp_path):
    # By tokens (no KV parked), and preempting an equal priority after the bound (as before deadlines).
    sharing = SlotSharingSettings(min_run_s=1.0, max_parked_kv_bytes=0, deadline_preemption=False)
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=sharing, slot_reclaim=None) as h:
            a = await deploy(h, "a", 1)
            b = await deploy(h, "b", 2, max_wait_before_preempt_s=3.0)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [a_worker] = h.cluster.live_workers()
            h.controller.notify_demand(a, 0)
            a_worker.request_ids[:] = ["r1", "r2"]
            a_worker.num_ongoing_requests = 2
            await h.tick(2.0)
            h.controller.notify_demand(b, 1, "gw", 0.0)
            await h.tick(1.0)  # b has waited ~1 s of 3: a keeps the slot
            assert kinds(h, "preemption") == [] and h.routes(a) == [a_worker.instance_id]
            outlook = h.controller.notify_demand(b, 1, "gw", 1.0)
            assert (outlook.status, outlook.position) == ("waiting_for_slot", 1)
            assert outlook.estimate_s == pytest.approx(2.0 + SSD_S, rel=0.5)  # until the bound, then a load
            assert "slots held by acme/a (serving 2)" in outlook.explain()
            h.controller.notify_demand(b, 1, "gw", 3.0)
            await h.tick(2.0)
            [preemption] = kinds(h, "preemption")
            assert (preemption["action"], preemption["instance_id"], preemption["model_id"]) == (
                "suspend", a_worker.instance_id, b)
            await eventually(lambda: h.cluster.suspensions == [(a_worker.instance_id, ["r1", "r2"])],
                             "a's requests suspended")
            await eventually(lambda: h.cluster.stopped_workers == [a_worker.instance_id], "a's worker stopped")
            status = h.controller.status()["slot_sharing"]
            assert [(s["model_id"], s["request_id"]) for s in status["suspended"]] == [(a, "r1"), (a, "r2")]
            assert status["counts"]["preemptions_suspended"] == 1 and status["counts"]["requests_suspended"] == 2
            # the gateway re-queues a's two requests: a now waits, b gets the held slot
            h.controller.notify_demand(a, 2, "gw", 0.0)
            h.controller.notify_demand(b, 1, "gw", 4.0)
            await h.tick()
            [b_worker] = [w for w in h.cluster.live_workers() if w.model_id == b]
            assert h.routes(b) == [b_worker.instance_id] and h.routes(a) == []
            assert h.controller.get_model(a)["num_desired_instances"] == 1  # suspended, not evicted
            # b serves; once a has waited its own bound (5 s), b is preempted in turn and a resumes
            h.controller.notify_demand(b, 0)
            b_worker.request_ids[:] = ["r3"]
            b_worker.num_ongoing_requests = 1
            h.controller.notify_demand(a, 2, "gw", 5.5)
            await h.tick(5.5)
            assert [p["instance_id"] for p in kinds(h, "preemption")][-1] == b_worker.instance_id
            await eventually(lambda: b_worker.instance_id in h.cluster.stopped_workers, "b's worker stopped")
            h.controller.notify_demand(a, 2, "gw", 6.0)
            await h.tick()
            assert len(h.routes(a)) == 1
            [resume] = kinds(h, "resume")
            assert (resume["model_id"], resume["request_ids"]) == (a, ["r1", "r2"])
            assert h.controller.status()["slot_sharing"]["suspended"] == [
                {"model_id": b, "request_id": "r3", "suspended_s": pytest.approx(0.0, abs=5.0), "kept": "tokens"}]
            assert h.cluster.parkings == [] and h.cluster.replays == []

    asyncio.run(scenario())


def test_a_model_never_preempts_one_of_higher_priority(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_reclaim=None,
                           slot_sharing=SlotSharingSettings(min_run_s=0.0)) as h:
            a = await deploy(h, "a", 1, priority=5)
            b = await deploy(h, "b", 2, max_wait_before_preempt_s=1.0)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [a_worker] = h.cluster.live_workers()
            h.controller.notify_demand(a, 0)
            a_worker.request_ids[:] = ["r1"]
            a_worker.num_ongoing_requests = 1
            await h.tick()
            h.controller.notify_demand(b, 1, "gw", 30.0)
            await h.tick(1.0)
            assert kinds(h, "preemption") == [] and h.cluster.suspensions == []
            assert f"{a_worker.instance_id} ({a}): priority 5 > 0" in h.controller.get_model(b)["last_placement"]["reason"]

    asyncio.run(scenario())


async def a_busy_with_b_and_c_deployed(h: Harness):
    """Models a, b and c deployed on one slot, a's instance serving a request."""
    a = await deploy(h, "a", 1)
    b = await deploy(h, "b", 2)
    c = await deploy(h, "c", 3)
    h.controller.notify_demand(a, 1)
    await h.tick()
    [a_worker] = h.cluster.live_workers()
    a_worker.request_ids[:] = ["r1"]
    a_worker.num_ongoing_requests = 1
    h.controller.notify_demand(a, 0)
    await h.tick()
    return a, b, c, a_worker


def test_waiting_models_get_freed_slots_oldest_request_first(tmp_path):
    """By age alone (deadline_order and deadline_eviction off): the order before issue 39."""
    async def scenario():
        sharing = SlotSharingSettings(preempt=False, deadline_order=False, deadline_eviction=False)
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=sharing) as h:
            a, b, c, a_worker = await a_busy_with_b_and_c_deployed(h)
            # c's request is older than b's, though b's model was deployed first
            h.controller.notify_demand(b, 1, "gw", 2.0)
            h.controller.notify_demand(c, 1, "gw", 7.0)
            assert h.controller.notify_demand(b, 1, "gw", 2.0).position == 2
            assert h.controller.notify_demand(c, 1, "gw", 7.0).position == 1
            await h.tick()
            assert kinds(h, "eviction") == []  # a is busy, and preemption is off
            a_worker.request_ids[:] = []
            a_worker.num_ongoing_requests = 0
            await h.tick(1.0)  # a idles: its instance is evicted for the head of the line
            [eviction] = kinds(h, "eviction")
            assert eviction["model_id"] == c
            await eventually(lambda: h.cluster.stopped_workers == [a_worker.instance_id], "a's worker stopped")
            for model_id, waited in ((b, 3.0), (c, 8.0)):
                h.controller.notify_demand(model_id, 1, "gw", waited)
            await h.tick()
            assert len(h.routes(c)) == 1 and h.routes(b) == []

    asyncio.run(scenario())


def test_a_request_that_can_still_meet_its_deadline_gets_the_freed_slot_before_an_older_lost_one(tmp_path):
    """Deadlines on (the defaults): c's request has waited 30 s, past its 5 s first-token deadline
    whatever happens now; b's is fresh and can meet its deadline. b is first in line, c does not
    evict a's idle instance (it has not waited `lost_wait_s`), b does."""
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=SlotSharingSettings(preempt=False)) as h:
            a, b, c, a_worker = await a_busy_with_b_and_c_deployed(h)
            h.controller.notify_demand(c, 1, "gw", 30.0, 30.0)
            h.controller.notify_demand(b, 1, "gw", 0.5, 0.5)
            assert h.controller.notify_demand(b, 1, "gw", 0.5, 0.5).position == 1
            assert h.controller.notify_demand(c, 1, "gw", 30.0, 30.0).position == 2
            a_worker.request_ids[:] = []
            a_worker.num_ongoing_requests = 0
            await h.tick(1.0)
            [eviction] = kinds(h, "eviction")
            assert eviction["model_id"] == b
            await eventually(lambda: h.cluster.stopped_workers == [a_worker.instance_id], "a's worker stopped")
            h.controller.notify_demand(b, 1, "gw", 1.5, 1.5)
            h.controller.notify_demand(c, 1, "gw", 31.0, 31.0)
            await h.tick()
            assert len(h.routes(b)) == 1 and h.routes(c) == []

    asyncio.run(scenario())


def test_a_lost_request_evicts_only_after_lost_wait_s(tmp_path):
    """c's only request has waited past its deadline: it does not take a's idle slot until it has
    waited `lost_wait_s` (here 40 s), and the reason says so."""
    async def scenario():
        sharing = SlotSharingSettings(preempt=False, eviction=EvictionSettings(lost_wait_s=40.0))
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=sharing) as h:
            a = await deploy(h, "a", 1)
            c = await deploy(h, "c", 3)
            h.controller.notify_demand(a, 1)
            await h.tick()
            h.controller.notify_demand(a, 0)
            await h.tick(2.0)
            h.controller.notify_demand(c, 1, "gw", 30.0, 30.0)
            await h.tick()
            assert kinds(h, "eviction") == []
            assert "lost_wait_s 40" in h.controller.get_model(c)["last_placement"]["reason"]
            h.controller.notify_demand(c, 1, "gw", 41.0, 41.0)
            await h.tick()
            [eviction] = kinds(h, "eviction")
            assert eviction["model_id"] == c

    asyncio.run(scenario())


def test_without_slot_sharing_nothing_is_evicted(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=None) as h:
            a = await deploy(h, "a", 1)
            b = await deploy(h, "b", 2)
            h.controller.notify_demand(a, 1)
            await h.tick()
            h.controller.notify_demand(a, 0)
            await h.tick(5.0)
            h.controller.notify_demand(b, 1, "gw", 20.0)
            await h.tick()
            assert kinds(h, "eviction") == [] and len(h.routes(a)) == 1 and h.routes(b) == []

    asyncio.run(scenario())


def test_notify_demand_refuses_a_bad_wait(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            a = await deploy(h, "a", 1)
            for bad in (-1.0, float("inf"), float("nan"), "3", True):
                with pytest.raises(ValueError, match="oldest_wait_s must be a finite number >= 0"):
                    h.controller.notify_demand(a, 1, "gw", bad)

    asyncio.run(scenario())


def test_suspended_requests_park_their_kv_within_the_budget_and_are_replayed_into_the_next_instance(tmp_path):
    sharing = SlotSharingSettings(min_run_s=0.0, max_parked_kv_bytes=2500)
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=sharing, slot_reclaim=None) as h:
            a = await deploy(h, "a", 1)
            b = await deploy(h, "b", 2, max_wait_before_preempt_s=1.0)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [a_worker] = h.cluster.live_workers()
            h.controller.notify_demand(a, 0)
            a_worker.request_ids[:] = ["r1", "r2", "r3"]
            a_worker.num_ongoing_requests = 3
            h.cluster.kv_bytes.update({"r1": 1000, "r2": 2000, "r3": 1000})  # r2 does not fit beside r1
            h.cluster.refuse_replay = {"r3"}
            await h.tick()
            h.controller.notify_demand(b, 1, "gw", 2.0)
            await h.tick(1.0)
            await eventually(lambda: h.cluster.stopped_workers == [a_worker.instance_id], "a's worker stopped")
            assert h.cluster.parkings == [(a_worker.instance_id, ["r1", "r3"])]
            assert h.cluster.suspensions == [(a_worker.instance_id, ["r2"])]  # over the budget: by its tokens
            [suspend] = kinds(h, "suspend")
            assert (suspend["kv_request_ids"], suspend["token_request_ids"]) == (["r1", "r3"], ["r2"])
            status = h.controller.status()["slot_sharing"]
            assert status["parked_kv_bytes"] == 2000
            assert [(s["request_id"], s["kept"]) for s in status["suspended"]] == [
                ("r1", "kv"), ("r2", "tokens"), ("r3", "kv")]
            # b is served and finishes; a's requests wait, so a gets the slot back and its parked
            # requests are replayed into its new instance before it is routed
            h.controller.notify_demand(b, 1, "gw", 2.5)
            await h.tick()
            [b_worker] = [w for w in h.cluster.live_workers() if w.model_id == b]
            h.controller.notify_demand(b, 0)
            h.controller.notify_demand(a, 3, "gw", 3.0)
            await h.tick(2.0)  # b idles: evicted for a
            await eventually(lambda: b_worker.instance_id in h.cluster.stopped_workers, "b's worker stopped")
            h.controller.notify_demand(a, 3, "gw", 5.0)
            await h.tick()
            [a_again] = [w for w in h.cluster.live_workers() if w.model_id == a]
            assert h.cluster.replays == [(a_again.instance_id, ["r1"])]  # r3's replay failed
            [resume] = kinds(h, "resume")
            assert resume["kept"] == {"r1": "kv", "r2": "tokens", "r3": "tokens"}
            counts = h.controller.status()["slot_sharing"]["counts"]
            assert (counts["requests_parked_with_kv"], counts["requests_resumed_with_kv"]) == (2, 1)
            assert h.controller.status()["slot_sharing"]["parked_kv_bytes"] == 0

    asyncio.run(scenario())


def test_a_small_popular_model_is_kept_and_a_rarely_used_one_evicted(tmp_path):
    """The frequency the workers' request counts give weighs in: of two idle instances with the
    same reload cost (the measured start overhead plus the same read), the rarely used one goes."""
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=2) as h:
            hot = await deploy(h, "hot", 1)
            rare = await deploy(h, "rare", 2)
            waiting = await deploy(h, "waiting", 3)
            for model_id in (hot, rare):
                h.controller.notify_demand(model_id, 1)
            await h.tick()
            workers = {w.model_id: w for w in h.cluster.live_workers()}
            workers[hot].num_requests_started = 20  # the gateway sent hot twenty requests
            for model_id in (hot, rare):
                h.controller.notify_demand(model_id, 0)
            await h.tick(1.0)
            h.controller.notify_demand(waiting, 1, "gw", 0.0)
            await h.tick()
            [eviction] = kinds(h, "eviction")
            assert eviction["victim_model_id"] == rare, eviction["reason"]

    asyncio.run(scenario())


def test_an_evicted_workers_process_goes_back_to_the_spare_pool_and_serves_the_next_model(tmp_path):
    async def scenario():
        # refills wait 100 s after a start, so the pool is short when the eviction comes (as under churn)
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, spare_workers_per_node=1,
                           spare_refill_delay_s=100.0) as h:
            h.cluster.spares_warm.set()
            a = await deploy(h, "a", 1)
            b = await deploy(h, "b", 2)
            await h.tick()  # the node's spare starts
            await eventually(lambda: h.controller.status()["spare_workers"], "a warm spare")
            h.controller.notify_demand(a, 1)
            await h.tick()
            [a_instance] = h.controller.get_model(a)["instances"]
            assert a_instance["from_spare"]
            h.controller.notify_demand(a, 0)
            h.controller.notify_demand(b, 1, "gw", 0.0)
            await h.tick(1.0)
            [eviction] = kinds(h, "eviction")
            await eventually(lambda: h.cluster.released_workers == [a_instance["instance_id"]], "a's worker released")
            assert h.cluster.stopped_workers == []  # let go of its model, not stopped
            assert [d["instance_id"] for d in kinds(h, "recycled")] == [a_instance["instance_id"]]
            h.controller.notify_demand(b, 1, "gw", 1.0)
            await h.tick()
            [b_instance] = h.controller.get_model(b)["instances"]
            assert b_instance["from_spare"] and b_instance["actor_name"] == a_instance["actor_name"]  # the same process
            assert len(h.routes(b)) == 1

    asyncio.run(scenario())


def test_a_loading_instances_outlook_adds_the_start_cost_and_never_says_zero_when_late(tmp_path):
    """The wait a client is told: placement's read estimate plus a start's measured fixed cost
    (before any start was measured, the configured default), counting down; once the instance is
    later than that, no number at all ("about 0.0 s" while it still loaded was seen for 11 s)."""
    async def scenario():
        from tests.controller.fake_cluster import FakeCluster
        from tests.controller.test_controller import RAY_NODE

        cluster = FakeCluster((RAY_NODE,), auto_ready=False)
        async with Harness(tmp_path, cluster=cluster) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            h.cluster.stores[NODE].hold("acme--m1", "ssd")
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            [instance] = h.controller.status()["instances"]
            read_s = instance["estimate_s"]
            assert read_s == pytest.approx(SSD_S)
            overhead_s = h.config.slot_sharing.eviction.start_overhead_s  # no start measured yet
            outlook = h.controller.notify_demand("acme/m1", 1)
            assert outlook.status == "loading" and outlook.estimate_s == pytest.approx(read_s + overhead_s)
            h.clock.advance(0.25)
            assert h.controller.notify_demand("acme/m1", 1).estimate_s == pytest.approx(read_s + overhead_s - 0.25)
            h.clock.advance(read_s + overhead_s)  # later than estimated
            late = h.controller.notify_demand("acme/m1", 1)
            assert late.status == "loading" and late.estimate_s is None
            assert late.reason.endswith("taking longer than estimated")
            assert late.progress_line() == "waiting for an instance to load"
            [worker] = h.cluster.live_workers()
            worker.finish_loading()
            await eventually(lambda: h.controller.notify_demand("acme/m1", 1).status == "ready", "ready")

    asyncio.run(scenario())


MIB = 2**20


def test_memory_is_the_slot_models_share_a_node_until_its_budget_and_evictions_free_it_until_a_newcomer_fits(
        tmp_path):
    """A node with 4 slots and a 1,100 MiB worker memory budget; an instance takes its 1 MB
    checkpoint plus its KV pool (512 MiB by default). a and b fit side by side; c asks for a 1,000
    MiB pool, so one eviction would leave it short (74 + 513 MiB): both idle instances go, in one
    decision, and c starts once they are gone."""
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=4, worker_memory_bytes=1100 * MIB) as h:
            a = await deploy(h, "a", 1, keep_alive_s=60.0)
            b = await deploy(h, "b", 2, keep_alive_s=60.0)
            c = "acme/c"
            h.cluster.model_bytes["acme--c"] = MODEL_BYTES
            await h.controller.deploy({**spec(c, h.source("c", 3), keep_alive_s=60.0), "kv_cache_bytes": 1000 * MIB})
            h.controller.notify_demand(a, 1)
            h.controller.notify_demand(b, 1)
            await h.tick()
            workers = {w.instance_id for w in h.cluster.live_workers()}
            assert len(workers) == 2 and h.routes(a) and h.routes(b)
            [node] = h.controller.status()["nodes"]
            share = MODEL_BYTES + 512 * MIB
            assert node["worker_memory"]["used_bytes"] == 2 * share
            assert node["worker_memory"]["free_bytes"] == 1100 * MIB - 2 * share
            assert sorted(i["model_id"] for i in node["worker_memory"]["instances"]) == [a, b]
            assert node["num_free_slots"] == 2  # slots are free: memory is what is short
            # Sharing the node by memory, they reserve no Ray CPU (their threads are set instead).
            assert [(w.num_cpus, w.num_threads) for w in h.cluster.live_workers()] == [(0, 1), (0, 1)]

            h.controller.notify_demand(a, 0)
            h.controller.notify_demand(b, 0)
            h.controller.notify_demand(c, 1, "gw", 0.0)
            await h.tick(1.0)
            [eviction] = kinds(h, "eviction")
            assert {eviction["instance_id"], *(v[0] for v in eviction["more_victims"])} == workers
            assert "until it fits" in eviction["reason"]
            assert h.routes(a) == [] and h.routes(b) == []
            [hold] = h.controller.status()["slot_sharing"]["holds"]
            assert (hold["model_id"], hold["memory_bytes"]) == (c, MODEL_BYTES + 1000 * MIB)
            # Their processes reserve no Ray CPU, so they go back to the spare pool for the next model.
            await eventually(lambda: sorted(d["instance_id"] for d in kinds(h, "recycled")) == sorted(workers),
                             "both evicted workers recycled")
            assert h.cluster.stopped_workers == []
            h.controller.notify_demand(c, 1, "gw", 1.0)
            await h.tick()
            assert len(h.routes(c)) == 1
            assert h.controller.status()["slot_sharing"]["counts"]["evictions"] == 2

    asyncio.run(scenario())


def test_where_memory_is_the_slot_a_model_scaled_to_zero_leaves_its_process_to_the_next_model(tmp_path):
    """Sharing a node by memory, a worker reserves no Ray CPU, so even one started fresh (no spare
    warm) is kept when its model scales to zero (sleeping turned off), and the next model's start
    takes it; without a budget, a fresh worker holds its model's Ray CPUs and is stopped."""
    async def scenario(budget):
        async with Harness(tmp_path / str(budget), cpu_worker_slots_per_node=4, worker_memory_bytes=budget,
                           spare_workers_per_node=1, spare_refill_delay_s=100.0, sleep_idle_instances=False) as h:
            a = await deploy(h, "a", 1, keep_alive_s=5.0)
            b = await deploy(h, "b", 2)
            h.controller.notify_demand(a, 1)
            await h.tick()  # no spare is warm yet: a fresh worker
            [a_instance] = h.controller.get_model(a)["instances"]
            assert not a_instance["from_spare"]
            h.controller.notify_demand(a, 0)
            await h.tick(1.0)
            await h.tick(6.0)  # past its keep-alive: scaled to zero
            assert [d["reason"] for d in kinds(h, "stop")] == ["scaling down to 0"]
            await eventually(lambda: h.controller.get_model(a)["instances"] == [], "a's instance gone")
            h.controller.notify_demand(b, 1)
            await h.tick()
            [b_instance] = h.controller.get_model(b)["instances"]
            return a_instance, b_instance, h.cluster.stopped_workers, kinds(h, "recycled")

    a, b, stopped, recycled = asyncio.run(scenario(4 << 30))
    assert [d["instance_id"] for d in recycled] == [a["instance_id"]] and stopped == []
    assert b["from_spare"] and b["actor_name"] == a["actor_name"]  # the same process
    a, b, stopped, recycled = asyncio.run(scenario(None))
    assert recycled == [] and stopped == [a["instance_id"]] and b["actor_name"] != a["actor_name"]


@pytest.mark.parametrize("fields, message", [
    ({"deadline_eviction": "yes"}, "SlotSharingSettings.deadline_eviction must be True or False, got 'yes'"),
    ({"deadline_order": 1}, "SlotSharingSettings.deadline_order must be True or False, got 1"),
    ({"deadline_preemption": None}, "SlotSharingSettings.deadline_preemption must be True or False, got None"),
    ({"starvation_bound_s": -1.0}, "SlotSharingSettings.starvation_bound_s must be a finite number >= 0, got -1.0"),
])
def test_slot_sharing_settings_refuse_what_they_cannot_mean(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SlotSharingSettings(**fields)


def test_while_slots_are_contended_an_idle_instance_is_kept_at_least_contended_keep_alive_s(tmp_path):
    """a's keep-alive is 10 s. b waits for the only slot with a request past saving (so it may not
    evict a yet): the slot is contended, and a is given back only after 60 s idle, not 10 s."""
    async def scenario():
        sharing = SlotSharingSettings(preempt=False, contended_keep_alive_s=60.0)
        async with Harness(tmp_path, cpu_worker_slots_per_node=1, slot_sharing=sharing) as h:
            a = await deploy(h, "a", 1)
            b = await deploy(h, "b", 2)
            h.controller.notify_demand(a, 1)
            await h.tick()
            [a_worker] = h.cluster.live_workers()
            h.controller.notify_demand(a, 0)
            await h.tick()
            for waited in (20.0, 35.0):  # a idle 15 s, then 30 s: past its 10 s keep-alive
                h.clock.advance(15.0)
                h.controller.notify_demand(b, 1, "gw", waited, waited)
                await h.tick()
                assert h.cluster.stopped_workers == [] and len(h.routes(a)) == 1
            assert "the floor while slots are contended" in h.controller.get_model(a)["last_scale"]["reason"]
            assert kinds(h, "eviction") == []  # b's request is past saving: it may not evict a yet
            await h.tick(31.0)  # idle 61 s: past the 60 s floor too
            await eventually(lambda: h.cluster.stopped_workers == [a_worker.instance_id], "a scaled to zero")

    asyncio.run(scenario())


def test_a_waiting_model_takes_the_slot_a_scale_down_frees_instead_of_evicting_another_instance(tmp_path):
    """The flake seen in CI (tests/controller/test_controller_integration.py): a model scaled down
    2 -> 1, and while that instance stopped, a waiting model evicted the other one, so the
    scaled-down model went to zero by eviction, not after its keep-alive, and a slot sat free."""
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=2) as h:
            a = await deploy(h, "a", 1, max_instances=2, target_ongoing_requests=1, keep_alive_s=60.0)
            b = await deploy(h, "b", 2, keep_alive_s=60.0)
            h.controller.notify_demand(a, 2)
            await h.tick()
            await h.tick()
            assert len(h.routes(a)) == 2
            h.controller.notify_demand(a, 0)
            h.cluster.stop_gate = asyncio.Event()  # the scaled-down instance stays stopping
            await h.tick(1.0)
            assert h.controller.get_model(a)["last_scale"]["reason"].startswith("scale down 2 -> 1:")
            [kept] = h.routes(a)

            h.controller.notify_demand(b, 1, "gw", 0.0)
            await h.tick(1.0)
            await h.tick(1.0)
            assert kinds(h, "eviction") == [] and h.routes(a) == [kept] and h.routes(b) == []
            assert h.controller.get_model(a)["num_desired_instances"] == 1

            h.cluster.stop_gate.set()
            await eventually(lambda: len(h.cluster.live_workers()) == 1, "the scaled-down worker stopped")
            h.controller.notify_demand(b, 1, "gw", 2.0)
            await h.tick()
            assert len(h.routes(b)) == 1 and h.routes(a) == [kept] and kinds(h, "eviction") == []

    asyncio.run(scenario())
