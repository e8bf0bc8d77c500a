"""What an instance does alone about a migration whose driver went away, and what it refuses:

* a request frozen on the source (by either method's stop) whose driver never comes back carries
  on there once its lease runs out, and its client gets exactly the unmoved output;
* an import begun on the destination and never committed is dropped, every block freed;
* a live driver keeps both leases through a slow step; one that stalls past the lease finds the
  request resumed, and the copy on the destination is dropped (the request finishes whole);
* instances of two checkpoints of one model (same shapes and vocabulary, other weights) refuse
  to move requests between them, naming both checkpoints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from loader import convert_checkpoint
from migration import (EngineEndpoint, KVMigrationConfig, MigrationMethod, MigrationRefusedError, MigrationStatus,
                       TokenMigrationConfig, migrate_request)
from tests.migration.conftest import ENGINE_CONFIG, NUM_KV_BLOCKS, TINY_DEMO
from tests.migration.migration_client import GREEDY, PROMPTS, SEEDED, stream_following
from worker import AsyncEngine, Engine, RequestState, SamplingParams, write_demo_model

SHORT_LEASE_S = 0.5
# Long enough that the request is still decoding when the stalled driver comes back to hand it over.
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
DEADLINE_S = 60  # a guard so a bug fails the test instead of hanging it


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


async def poll(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # a poll interval, bounded by the deadline


async def idle(endpoint: EngineEndpoint) -> bool:
    tracked, free = await endpoint.async_engine.call(
        lambda engine: (engine.requests.request_ids(), engine.block_manager.num_free_blocks))
    return tracked == [] and free == NUM_KV_BLOCKS


@pytest.mark.parametrize("stop", ["freeze_request", "send_kv"])
def test_a_request_frozen_by_a_driver_that_vanished_finishes_whole_on_its_source(endpoints, unmoved, stop):
    source, _ = endpoints
    expected = unmoved(PROMPTS[1], SEEDED)

    async def driver_dies_after_the_stop():
        # The stop, then nothing: no release, no unfreeze, no renewal (the controller died).
        if stop == "freeze_request":
            await source.freeze_request("orphan", lease_s=SHORT_LEASE_S)
        else:
            await source.send_kv("orphan", 0, freeze=True, lease_s=SHORT_LEASE_S)
        assert (await source.request_progress("orphan")).state is RequestState.FROZEN
        assert source.holds_lease("orphan")

    received = run(stream_following(source, {}, "orphan", PROMPTS[1], SEEDED, migrate_after=10,
                                    migrate=driver_dies_after_the_stop))
    assert received.whole == expected.whole and received.finish_reason == "length"
    assert received.num_handoffs == 0 and not source.holds_lease("orphan")


def test_an_import_whose_driver_vanished_is_dropped_and_its_blocks_freed(endpoints):
    source, dest = endpoints

    async def main():
        outputs = source.async_engine.generate(PROMPTS[0], GREEDY, "half-moved")
        await anext(outputs)
        snapshot = await source.export_request("half-moved")
        await dest.begin_import(snapshot, snapshot.num_tokens, lease_s=SHORT_LEASE_S)  # then nothing
        assert (await dest.request_progress("half-moved")).state is RequestState.FROZEN
        assert not await idle(dest)
        await poll(lambda: idle(dest), "the abandoned import to be dropped")
        assert (await dest.request_progress("half-moved")).state is RequestState.UNKNOWN
        await outputs.aclose()  # the source's client leaves: the autouse check finds it empty too

    run(main())


class SlowCommit:
    """The destination, with a commit that takes ``delay_s`` (a busy instance)."""

    def __init__(self, inner: EngineEndpoint, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def commit_import(self, snapshot):
        await asyncio.sleep(self.delay_s)  # the slow step under test, not a synchronisation
        await self.inner.commit_import(snapshot)


class NeverRenews:
    """The source, as seen by a driver that stalls: its renewals never arrive."""

    def __init__(self, inner: EngineEndpoint) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def renew_lease(self, request_id, lease_s=None):
        return True


class CommitsOnceTheSourceResumed:
    """The destination of a stalled driver: its commit comes only after the source gave up the
    freeze and runs the request again."""

    def __init__(self, inner: EngineEndpoint, source: EngineEndpoint) -> None:
        self.inner = inner
        self.source = source

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def commit_import(self, snapshot):
        async def resumed() -> bool:
            return (await self.source.request_progress(snapshot.request_id)).state is not RequestState.FROZEN

        await poll(resumed, "the source to resume the request")
        await self.inner.commit_import(snapshot)


def config(method: MigrationMethod, lease_s: float) -> dict:
    if method is MigrationMethod.KV:
        return {"kv_config": KVMigrationConfig(lease_s=lease_s)}
    return {"token_config": TokenMigrationConfig(lease_s=lease_s)}


@pytest.mark.parametrize("method", [MigrationMethod.KV, MigrationMethod.TOKENS])
def test_a_live_driver_keeps_its_leases_through_a_step_longer_than_the_lease(endpoints, unmoved, method):
    source, dest = endpoints
    expected = unmoved(PROMPTS[3], GREEDY)
    slow = SlowCommit(dest, delay_s=4 * SHORT_LEASE_S)
    received = run(stream_following(
        source, {"dst": dest}, "slow", PROMPTS[3], GREEDY, migrate_after=5,
        migrate=lambda: migrate_request(source, slow, "slow", method, **config(method, SHORT_LEASE_S))))
    assert received.outcome.status is MigrationStatus.MIGRATED, received.outcome.error
    assert received.num_handoffs == 1 and received.whole == expected.whole


@pytest.mark.parametrize("method", [MigrationMethod.KV, MigrationMethod.TOKENS])
def test_a_driver_stalled_past_the_lease_finds_the_request_resumed_and_drops_its_copy(endpoints, unmoved, method):
    source, dest = endpoints
    expected = unmoved(PROMPTS[3], LONG)
    stalled = CommitsOnceTheSourceResumed(dest, source)
    received = run(stream_following(
        source, {"dst": dest}, "stalled", PROMPTS[3], LONG, migrate_after=5,
        migrate=lambda: migrate_request(NeverRenews(source), stalled, "stalled", method,
                                        **config(method, SHORT_LEASE_S))))
    outcome = received.outcome
    assert outcome.status is MigrationStatus.FAILED
    assert outcome.error.startswith(f"the source resumed the request before the hand-off (its {SHORT_LEASE_S:g} s "
                                    "freeze lease ran out); it carries on there")
    assert received.num_handoffs == 0 and received.whole == expected.whole
    # (the autouse check then finds the destination's copy gone and every block free)


def test_renewing_extends_only_what_is_leased(endpoints):
    source, dest = endpoints

    async def main():
        outputs = source.async_engine.generate(PROMPTS[2], GREEDY, "leased")
        await anext(outputs)
        assert await source.renew_lease("leased") is False  # running: nothing leased
        await source.freeze_request("leased")
        assert await source.renew_lease("leased", 60.0) is True
        await source.unfreeze_request("leased")
        assert await source.renew_lease("leased") is False and not source.holds_lease("leased")
        await outputs.aclose()

    run(main())


# ---- checkpoints -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory, model_dir):
    """(this model as a thaw checkpoint, the same model trained again: other weights, same shapes)."""
    root = tmp_path_factory.mktemp("checkpoints")
    retrained = write_demo_model(root / "hf-retrained", dataclasses.replace(TINY_DEMO, seed=1))
    convert_checkpoint(model_dir, root / "v1", progress=False)
    convert_checkpoint(retrained, root / "v2", progress=False)
    engines = [AsyncEngine(Engine(root / name, ENGINE_CONFIG)) for name in ("v1", "v2")]
    yield EngineEndpoint(engines[0], instance_id="v1"), EngineEndpoint(engines[1], instance_id="v2")
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize("method", [MigrationMethod.KV, MigrationMethod.TOKENS])
def test_a_request_never_moves_to_another_checkpoint_of_its_model(other_checkpoint, method):
    v1, v2 = other_checkpoint
    assert v1.checkpoint_id != v2.checkpoint_id
    expected = run(stream_following(v1, {}, "alone", PROMPTS[4], GREEDY))
    received = run(stream_following(v1, {"v2": v2}, "pinned", PROMPTS[4], GREEDY, migrate_after=5,
                                    migrate=lambda: migrate_request(v1, v2, "pinned", method)))
    outcome = received.outcome
    assert outcome.status is MigrationStatus.REFUSED
    assert (f"request 'pinned' was computed by checkpoint {v1.checkpoint_id} and this instance serves checkpoint "
            f"{v2.checkpoint_id}") in outcome.error
    assert received.num_handoffs == 0 and received.whole == expected.whole
    assert run(idle(v2))


def test_every_snapshot_a_source_hands_out_names_its_checkpoint(other_checkpoint):
    v1, v2 = other_checkpoint

    async def main():
        outputs = v1.async_engine.generate(PROMPTS[0], GREEDY, "named")
        await anext(outputs)
        exported = await v1.export_request("named")
        shipped, _ = await v1.send_kv("named", 0, freeze=False)
        frozen = await v1.freeze_request("named")
        with pytest.raises(MigrationRefusedError, match=f"serves checkpoint {v2.checkpoint_id}"):
            await v2.begin_import(frozen, frozen.num_tokens)
        await v1.unfreeze_request("named")
        await outputs.aclose()
        return exported, shipped, frozen

    snapshots = run(main())
    assert [s.checkpoint_id for s in snapshots] == [v1.checkpoint_id] * 3
    assert run(idle(v2)) and not v2.holds_lease("named")  # the refused handshake took nothing in
