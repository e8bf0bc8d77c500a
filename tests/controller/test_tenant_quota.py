"""Tenant quotas: the `TenantQuota` record and its pure checks with plain numbers, then the
controller enforcing ``max_instances`` at placement (fake cluster, fake clock, real SQLite):
a tenant at its quota gets no new instance and the refusal names the quota, another tenant is
unaffected, a raised quota lets the waiting model in, and a restarted controller keeps it."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from controller import (InvalidSpecError, SpecError, TenantQuota, UnknownTenantError, instances_over_quota,
                        open_state_store, queued_over_quota)
from tests.controller.test_controller import MODEL_BYTES, Harness, spec

ACME_AT_ONE = ("tenant 'acme' has 1 instances loading or ready, its quota (max_instances 1); "
               "no new instance until one of them stops")


# --- the record and the checks ------------------------------------------------------------------


def test_quota_validates_each_field_and_round_trips():
    assert TenantQuota() == TenantQuota(max_instances=None, max_queued_requests=None) and TenantQuota().unlimited
    quota = TenantQuota(max_instances=2, max_queued_requests=50)
    assert quota.to_dict() == {"max_instances": 2, "max_queued_requests": 50} and not quota.unlimited
    assert TenantQuota.from_dict(quota.to_dict()) == quota
    assert TenantQuota.from_dict({"max_queued_requests": 7}) == TenantQuota(max_queued_requests=7)
    assert pickle.loads(pickle.dumps(quota)) == quota
    for field in ("max_instances", "max_queued_requests"):
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(SpecError) as info:
                TenantQuota.from_dict({field: bad})
            assert info.value.field == field
            assert str(info.value) == f"{field}: must be an integer >= 1, or null for no limit; got {bad!r}"
    with pytest.raises(SpecError) as info:
        TenantQuota.from_dict({"max_instance": 1})
    assert (info.value.field, info.value.reason) == (
        "max_instance", "unknown quota field; the fields are max_instances, max_queued_requests")
    with pytest.raises(SpecError, match="quota: must be an object"):
        TenantQuota.from_dict([1, 2])


def test_updated_changes_only_the_fields_named():
    quota = TenantQuota(max_instances=2, max_queued_requests=50)
    assert quota.updated({"max_instances": 3}) == TenantQuota(max_instances=3, max_queued_requests=50)
    assert quota.updated({"max_queued_requests": None}) == TenantQuota(max_instances=2)
    assert quota.updated({}) == quota
    with pytest.raises(SpecError) as info:
        quota.updated({"max_instances": 0})
    assert info.value.field == "max_instances"


@pytest.mark.parametrize(("limit", "num_instances", "num_new", "refused"), [
    (None, 1000, 1, False),
    (2, 0, 1, False),
    (2, 1, 1, False),
    (2, 2, 1, True),
    (2, 1, 2, True),
    (2, 5, 1, True),  # lowered below what the tenant holds: nothing stops, nothing starts
])
def test_instances_over_quota(limit, num_instances, num_new, refused):
    reason = instances_over_quota("acme", TenantQuota(max_instances=limit), num_instances, num_new)
    expected = (f"tenant 'acme' has {num_instances} instances loading or ready, its quota (max_instances {limit}); "
                "no new instance until one of them stops")
    assert reason == (expected if refused else None)


@pytest.mark.parametrize(("limit", "num_queued", "refused"), [
    (None, 10_000, False), (3, 0, False), (3, 2, False), (3, 3, True), (3, 4, True)])
def test_queued_over_quota(limit, num_queued, refused):
    reason = queued_over_quota("acme", TenantQuota(max_queued_requests=limit), num_queued)
    expected = (f"tenant 'acme' has {num_queued} requests waiting for instances, its quota "
                f"(max_queued_requests {limit}); retry later")
    assert reason == (expected if refused else None)


# --- the controller -----------------------------------------------------------------------------


async def deploy(h: Harness, model_id: str, seed: int, **autoscaling) -> str:
    tenant, name = model_id.split("/")
    h.cluster.model_bytes[f"{tenant}--{name}"] = MODEL_BYTES
    await h.controller.deploy(spec(model_id, h.source(f"{tenant}-{name}", seed), **autoscaling))
    return model_id


def live_models(h: Harness) -> list[str]:
    return sorted(w.model_id for w in h.cluster.live_workers())


def quota_refusals(h: Harness, model_id: str) -> list[str]:
    return [d["reason"] for d in h.controller.status()["recent_decisions"]
            if d["kind"] == "placement" and d["model_id"] == model_id and d["instance_id"] is None]


def test_a_tenant_at_max_instances_gets_no_new_instance_and_another_tenant_is_unaffected(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=4) as h:  # room for all: only the quota limits
            m1 = await deploy(h, "acme/m1", 1, min_instances=1)
            m2 = await deploy(h, "acme/m2", 2, min_instances=1)
            m3 = await deploy(h, "other/m3", 3, min_instances=1)
            assert h.controller.set_tenant_quota("acme", {"max_instances": 1}) == {
                "max_instances": 1, "max_queued_requests": None}

            await h.tick()
            assert live_models(h) == [m1, m3]  # models are placed in id order: acme/m1 took acme's one
            m2_state = h.controller.get_model(m2)
            assert m2_state["num_desired_instances"] == 1 and m2_state["instances"] == []  # wanted, refused
            assert m2_state["last_placement"]["reason"] == ACME_AT_ONE
            assert m2_state["last_placement"]["node_id"] is None
            assert [m["placement_reason"] for m in h.controller.status()["models"] if m["model_id"] == m2] == [
                ACME_AT_ONE]
            assert len(h.routes(m3)) == 1  # the other tenant: placed and serving

            await h.tick(1.0)
            await h.tick(1.0)
            assert live_models(h) == [m1, m3]
            assert quota_refusals(h, m2) == [ACME_AT_ONE]  # recorded once, not every tick

            # Raised: the waiting model is placed on the next tick.
            assert h.controller.set_tenant_quota("acme", {"max_instances": 2, "max_queued_requests": 50}) == {
                "max_instances": 2, "max_queued_requests": 50}
            await h.tick()
            assert live_models(h) == [m1, m2, m3]

        with open_state_store(h.config.state_location) as store:  # saved, so a restart keeps it
            assert store.get_tenant_quota("acme") == TenantQuota(max_instances=2, max_queued_requests=50)

        async with Harness(tmp_path, cluster=h.cluster, cpu_worker_slots_per_node=4) as restarted:
            assert restarted.controller.tenant_quotas() == {"acme": {"max_instances": 2, "max_queued_requests": 50}}

    asyncio.run(scenario())


def test_a_tenant_at_its_quota_takes_no_slot_from_another_tenant(tmp_path):
    """With the only slot held by another tenant's idle instance, a waiting model of a tenant at
    its quota evicts nothing: the quota is checked before eviction, reclaim or preemption."""

    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=2) as h:
            m1 = await deploy(h, "acme/m1", 1, min_instances=1)
            m3 = await deploy(h, "other/m3", 3, keep_alive_s=60.0)
            m2 = await deploy(h, "acme/m2", 2, keep_alive_s=60.0)
            h.controller.set_tenant_quota("acme", {"max_instances": 1})
            h.controller.notify_demand(m3, 1)
            await h.tick()
            h.controller.notify_demand(m3, 0)  # served; other/m3 idles, inside its keep-alive
            assert live_models(h) == [m1, m3]

            h.controller.notify_demand(m2, 3, "gw", 0.5)
            await h.tick(1.0)
            await h.tick(1.0)
            assert live_models(h) == [m1, m3] and h.cluster.stopped_workers == []
            assert [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "eviction"] == []
            assert h.controller.get_model(m2)["last_placement"]["reason"] == ACME_AT_ONE

    asyncio.run(scenario())


def test_set_tenant_quota_refuses_bad_fields_and_unknown_tenants_and_lifting_removes_the_record(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await deploy(h, "acme/m1", 1)  # deploying creates the tenant
            with pytest.raises(InvalidSpecError) as bad:
                h.controller.set_tenant_quota("acme", {"max_queued_requests": 0})
            assert (bad.value.field, bad.value.reason) == (
                "max_queued_requests", "must be an integer >= 1, or null for no limit; got 0")
            copy = pickle.loads(pickle.dumps(bad.value))  # crosses Ray with its field
            assert (copy.field, copy.reason) == (bad.value.field, bad.value.reason)
            with pytest.raises(InvalidSpecError) as bad:
                h.controller.set_tenant_quota("Acme", {"max_instances": 1})
            assert bad.value.field == "tenant"
            with pytest.raises(UnknownTenantError) as unknown:
                h.controller.set_tenant_quota("nobody", {"max_instances": 1})
            assert str(unknown.value) == "tenant 'nobody' does not exist; create it first (thaw tenants create nobody)"
            assert pickle.loads(pickle.dumps(unknown.value)).tenant == "nobody"
            assert h.controller.tenant_quotas() == {}

            h.controller.set_tenant_quota("acme", {"max_instances": 3, "max_queued_requests": 9})
            assert h.controller.set_tenant_quota("acme", {"max_instances": None}) == {
                "max_instances": None, "max_queued_requests": 9}
            assert h.controller.tenant_quotas() == {"acme": {"max_instances": None, "max_queued_requests": 9}}
            h.controller.set_tenant_quota("acme", {"max_queued_requests": None})
            assert h.controller.tenant_quotas() == {}
            with open_state_store(h.config.state_location) as store:
                assert store.list_tenant_quotas() == {}

    asyncio.run(scenario())
