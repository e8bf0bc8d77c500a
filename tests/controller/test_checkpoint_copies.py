"""Which tier a cold start reads from, and when DRAM should take a copy (`store_tier`,
`dram_can_take`), and the promotion into DRAM after a start (its success path is also in
test_controller.py's scale-to-zero test)."""

from __future__ import annotations

import asyncio

from controller.cluster_node import dram_can_take, store_tier
from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import MODEL_BYTES, NODE, RAY_NODE, Harness, make_config, spec


def test_store_tier_reads_dram_only_when_the_model_is_there_and_dram_takes_what_fits(tmp_path):
    config = make_config(tmp_path, dram_capacity_bytes=3 * MODEL_BYTES)
    cluster = FakeCluster()
    cluster.model_bytes.update({"x": MODEL_BYTES, "y": MODEL_BYTES, "m": MODEL_BYTES})
    store = asyncio.run(cluster.connect_node_store("n", RAY_NODE, config.node_store_config("n")))
    assert store_tier(None, "m", config) == "ssd" and not dram_can_take(None, "m", MODEL_BYTES, config)
    assert store_tier(store.report(), "m", config) == "ssd"  # not in DRAM: read from SSD, no copy first
    assert dram_can_take(store.report(), "m", MODEL_BYTES, config)
    store.hold("x", "dram", pinned=True)
    store.hold("y", "dram", pinned=True)
    assert dram_can_take(store.report(), "m", MODEL_BYTES, config)  # exactly fits beside the pinned two
    assert not dram_can_take(store.report(), "m", MODEL_BYTES + 1, config)
    store.tiers["dram"]["y"] = False  # unpinned entries can be evicted for it
    assert dram_can_take(store.report(), "m", 2 * MODEL_BYTES, config)
    store.hold("m", "dram")
    assert store_tier(store.report(), "m", config) == "dram" and not dram_can_take(store.report(), "m", 1, config)
    no_dram = make_config(tmp_path, dram_capacity_bytes=0)
    assert store_tier(None, "m", no_dram) == "ssd" and not dram_can_take(None, "m", 1, no_dram)


def test_a_full_dram_refuses_the_promotion_and_the_instance_serves_on_from_ssd(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            h.cluster.stores[NODE].dram_full = True
            await h.tick()
            [instance] = h.controller.get_model("acme/m1")["instances"]
            assert (instance["state"], instance["tier"]) == ("ready", "ssd")
            assert h.cluster.live_workers()[0].model_dir == f"/fake/{NODE}/ssd/acme--m1"
            await h.tick(advance_s=5.0)  # settled: the promotion is tried, and the full tier refuses it
            await asyncio.sleep(0)  # let the background copy task run (it fails at once)
            assert h.cluster.stores[NODE].num_prefetch_calls == 1  # tried once ...
            assert h.cluster.stores[NODE].prefetches == [] and "acme--m1" not in h.cluster.stores[NODE].tiers["dram"]
            assert not [d for d in h.controller.status()["recent_decisions"] if d.get("kind") == "promote"]
            [instance] = h.controller.get_model("acme/m1")["instances"]
            assert instance["state"] == "ready"

    asyncio.run(scenario())
