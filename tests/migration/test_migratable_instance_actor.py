"""Migration between two real Ray actors, read the way the gateway will read it: a client streaming
with `follow_generation` gets exactly the unmoved output (seeded sampling, both methods) while the
request moves under it, the KV blocks going through Ray's object store; a destination killed
mid-migration (a real `ray.kill`) leaves the request finishing on the source, whole; a request
frozen by a driver that died streams on from its source once the freeze's lease runs out; a stream
that stays quiet with no progress ends with `StreamIdleTimeout` and its request is cancelled; a
recovery continues on another checkpoint of the model (a live migration would be refused); and an
instance shut down ends its streams "suspended", the ones it started and the ones it took in, so
the gateway continues them elsewhere."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import ray

from migration import MigrationMethod, MigrationStatus, RayEndpoint, follow_generation, migrate_request
from migration import start_migratable_instance
from worker import stop_instance_worker

ENGINE_CONFIG = {"block_size": 8, "num_kv_blocks": 64}
SEEDED = {"temperature": 1.0, "top_p": 0.95, "seed": 99, "max_tokens": 150, "ignore_eos": True}
PROMPT = "Paged attention stores keys and values"
NAMESPACE = f"thaw-migration-{uuid.uuid4().hex[:8]}"


def start(instance_id: str, model_dir):
    return start_migratable_instance(instance_id, "acme/demo", str(model_dir), ENGINE_CONFIG,
                                     name=instance_id, namespace=NAMESPACE, num_cpus=0.5)


@pytest.fixture(scope="module")
def instances(local_ray, model_dir):
    handles = {instance_id: start(instance_id, model_dir) for instance_id in ("inst-a", "inst-b")}
    ray.get([handle.ready.remote() for handle in handles.values()], timeout=120)
    yield handles
    for handle in handles.values():
        stop_instance_worker(handle)


async def read_following(handles, request_id, *, migrate_after=None, migrate=None):
    """Chunks as the client receives them; ``migrate`` starts once ``migrate_after`` chunks arrived."""
    async def resolve(instance_id):
        return handles[instance_id]

    chunks, task = [], None
    async for chunk in follow_generation(handles["inst-a"], request_id, PROMPT, SEEDED, resolve=resolve):
        chunks.append(chunk)
        if migrate is not None and task is None and len(chunks) == migrate_after:
            task = asyncio.create_task(migrate())
    return chunks, (await task if task is not None else None)


def whole(chunks):
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason


def idle(handle):
    stats = ray.get(handle.stats.remote())
    return stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running_requests == 0


@pytest.mark.parametrize("method", [MigrationMethod.KV, MigrationMethod.TOKENS])
def test_a_client_following_the_request_gets_exactly_the_unmoved_output(instances, method):
    source = RayEndpoint(instances["inst-a"], "inst-a")
    dest = RayEndpoint(instances["inst-b"], "inst-b")

    async def freeze_then_migrate(request_id):
        # Frozen first: on a busy machine the tiny model could otherwise finish its 150 tokens
        # before the token rounds end (outcome FINISHED, seen in CI). Migrating while the source
        # decodes is covered on in-process engines (test_kv_migration, test_token_migration).
        await source.freeze_request(request_id)
        return await migrate_request(source, dest, request_id, method)

    async def main():
        expected, _ = await read_following(instances, f"alone-{method.value}")
        moved, outcome = await read_following(
            instances, f"moving-{method.value}", migrate_after=7,
            migrate=lambda: freeze_then_migrate(f"moving-{method.value}"))
        return expected, moved, outcome

    expected, moved, outcome = asyncio.run(main())
    assert outcome.status is MigrationStatus.MIGRATED, outcome.error
    assert whole(moved) == whole(expected) and len(whole(moved)[0]) == 150
    assert [c.num_completion_tokens for c in moved] == list(range(1, 151))  # running totals carry on
    assert moved[-1].num_prompt_tokens == expected[-1].num_prompt_tokens
    if method is MigrationMethod.KV:
        assert outcome.num_blocks_copied > 0 and outcome.num_tokens_after_stop == 0
    assert idle(instances["inst-a"]) and idle(instances["inst-b"])


class KilledOnArrival(RayEndpoint):
    """The destination's actor is killed (for real) as the step named ``kill_at`` reaches it."""

    def __init__(self, handle, instance_id, kill_at: str) -> None:
        super().__init__(handle, instance_id)
        self.kill_at = kill_at

    async def receive_kv(self, snapshot, first_block, payload):
        if self.kill_at == "receive_kv":
            ray.kill(self.handle, no_restart=True)
        return await super().receive_kv(snapshot, first_block, payload)

    async def commit_import(self, snapshot):
        if self.kill_at == "commit_import":
            ray.kill(self.handle, no_restart=True)
        return await super().commit_import(snapshot)


def test_a_destination_killed_mid_migration_leaves_the_request_whole_on_the_source(instances, model_dir):
    # Killed after the stop's copy: the source had stopped the request and must resume it. (Earlier
    # failures, with the source still decoding, are covered in process by test_kv_migration.py.)
    kill_at = "commit_import"
    doomed = start(f"inst-doomed-{kill_at}", model_dir)
    ray.get(doomed.ready.remote(), timeout=120)
    source = RayEndpoint(instances["inst-a"], "inst-a")
    dest = KilledOnArrival(doomed, "inst-doomed", kill_at)

    async def freeze_then_migrate(request_id):
        # Frozen first, as above: the tiny model once finished its 150 tokens before the migration
        # stopped it (outcome FINISHED, in CI after decode got faster). The undo must then resume it.
        await source.freeze_request(request_id)
        return await migrate_request(source, dest, request_id)

    async def main():
        expected, _ = await read_following(instances, f"alone-{kill_at}")
        moved, outcome = await read_following(
            instances, f"moving-{kill_at}", migrate_after=5,
            migrate=lambda: freeze_then_migrate(f"moving-{kill_at}"))
        return expected, moved, outcome

    expected, moved, outcome = asyncio.run(main())
    assert outcome.status is MigrationStatus.FAILED and "Actor" in outcome.error
    assert whole(moved) == whole(expected) and moved[-1].finish_reason == "length"
    assert idle(instances["inst-a"])


def test_a_spare_takes_a_model_with_assign_and_then_takes_migrated_requests_under_that_id(instances, model_dir):
    # The platform starts its workers as spares and assigns them a model later: such a worker must
    # be a migration endpoint too, known by the instance id ``assign`` gave it.
    from migration import start_migratable_spare
    from worker import SpareWorkerError

    spare = start_migratable_spare(name="inst-spare", namespace=NAMESPACE)
    with pytest.raises(SpareWorkerError):  # no model, nothing to migrate (and said so, not a hang)
        asyncio.run(RayEndpoint(spare, "inst-spare").begin_import(None, 0))
    ray.get(spare.assign.remote("inst-assigned", "acme/demo", str(model_dir), ENGINE_CONFIG, 1), timeout=60)
    ray.get(spare.ready.remote(), timeout=120)
    handles = {**instances, "inst-assigned": spare}
    source = RayEndpoint(instances["inst-a"], "inst-a")
    dest = RayEndpoint(spare, "inst-assigned")

    async def freeze_then_migrate(request_id):  # frozen first, as above: it must not end before the move
        await source.freeze_request(request_id)
        return await migrate_request(source, dest, request_id)

    async def main():
        expected, _ = await read_following(handles, "alone-spare")
        moved, outcome = await read_following(
            handles, "moving-spare", migrate_after=5, migrate=lambda: freeze_then_migrate("moving-spare"))
        return expected, moved, outcome

    try:
        expected, moved, outcome = asyncio.run(main())
        assert outcome.status is MigrationStatus.MIGRATED, outcome.error
        assert ray.get(instances["inst-a"].handoff_target.remote("moving-spare")) == "inst-assigned"
        assert whole(moved) == whole(expected)
        assert idle(instances["inst-a"]) and idle(spare)
    finally:
        stop_instance_worker(spare)


def test_a_request_frozen_by_a_driver_that_died_streams_on_from_its_source(instances):
    # The controller driving a migration dies right after the stop: nobody releases or unfreezes
    # the request. Its freeze lease runs out and the client's stream goes on from the source.
    source = RayEndpoint(instances["inst-a"], "inst-a")

    async def main():
        expected, _ = await read_following(instances, "alone-orphan")
        orphaned, _ = await read_following(instances, "orphan", migrate_after=5,
                                           migrate=lambda: source.freeze_request("orphan", lease_s=1.0))
        return expected, orphaned

    expected, orphaned = asyncio.run(asyncio.wait_for(main(), 120))
    assert whole(orphaned) == whole(expected) and len(whole(orphaned)[0]) == 150
    assert [c.num_completion_tokens for c in orphaned] == list(range(1, 151))
    assert idle(instances["inst-a"])


def test_a_stream_that_stays_quiet_with_no_progress_ends_with_an_idle_timeout(instances):
    from migration import StreamIdleTimeout
    from worker import RequestState

    source = RayEndpoint(instances["inst-a"], "inst-a")

    async def resolve(instance_id):
        return instances[instance_id]

    async def main():
        chunks = []
        stream = follow_generation(instances["inst-a"], "stuck", PROMPT, SEEDED, resolve=resolve, idle_timeout_s=2.0)
        with pytest.raises(StreamIdleTimeout) as raised:
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 3:  # a driver holds it frozen for longer than the client waits
                    await source.freeze_request("stuck", lease_s=600.0)
        return chunks, raised.value

    chunks, timeout = asyncio.run(asyncio.wait_for(main(), 120))
    assert 3 <= len(chunks) < 150 and timeout.last_state is RequestState.FROZEN
    assert timeout.request_id == "stuck" and timeout.idle_s >= 2.0
    # Leaving the stream cancelled the request where it was: nothing is left running.
    deadline = time.monotonic() + 60
    while not idle(instances["inst-a"]):
        assert time.monotonic() < deadline, "the timed-out request was not cancelled on its instance"
        time.sleep(0.05)  # a poll interval, bounded by the deadline
    progress = ray.get(instances["inst-a"].request_progress.remote("stuck"))
    assert progress.state is RequestState.UNKNOWN


def test_a_recovery_continues_on_another_checkpoint_of_the_model(instances, tmp_path):
    # The decision documented in migratable_instance_actor: a live migration never crosses
    # checkpoints, but a recovery (its instance is dead) continues on the redeployed weights rather
    # than failing the client's stream.
    import dataclasses

    from loader import convert_checkpoint
    from tests.migration.conftest import TINY_DEMO
    from worker import write_demo_model

    retrained = write_demo_model(tmp_path / "hf-retrained", dataclasses.replace(TINY_DEMO, seed=1))
    convert_checkpoint(retrained, tmp_path / "v2", progress=False)
    redeployed = start("inst-v2", tmp_path / "v2")
    ray.get(redeployed.ready.remote(), timeout=120)
    handles = {**instances, "inst-v2": redeployed}

    async def resolve(instance_id):
        return handles[instance_id]

    async def main():
        expected, _ = await read_following(instances, "alone-v1")
        sent = [t for c in expected[:10] for t in c.token_ids]  # what the client had when v1 died
        rest = [c async for c in follow_generation(redeployed, "recovered", PROMPT, SEEDED, resolve=resolve,
                                                   sent_token_ids=sent)]
        return expected, sent, rest

    try:
        expected, sent, rest = asyncio.run(asyncio.wait_for(main(), 120))
        assert len(sent) == 10 and rest[-1].finish_reason == "length"
        assert [c.num_completion_tokens for c in rest] == list(range(11, 151))  # usage goes on from the 10 sent
        assert idle(redeployed)
    finally:
        stop_instance_worker(redeployed)


def test_an_instance_shut_down_ends_its_own_and_its_recovered_streams_suspended(instances, model_dir):
    stopping = start("inst-stop", model_dir)
    ray.get(stopping.ready.remote(), timeout=120)

    async def resolve(instance_id):
        return stopping

    async def main():
        expected, _ = await read_following(instances, "reference-stop")
        sent = [t for c in expected[:10] for t in c.token_ids]
        own = follow_generation(stopping, "own", PROMPT, SEEDED, resolve=resolve)
        taken_in = follow_generation(stopping, "taken-in", PROMPT, SEEDED, resolve=resolve, sent_token_ids=sent)
        firsts = [await anext(own), await anext(taken_in)]
        await asyncio.to_thread(ray.get, stopping.shutdown.remote(30.0), timeout=60)
        return expected, firsts, [[c async for c in own], [c async for c in taken_in]]

    try:
        expected, firsts, rests = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        stop_instance_worker(stopping)
    for first, rest in zip(firsts, rests):
        chunks = [first, *rest]
        # Cut short by the stop, and said so: the gateway requeues "suspended"; an "abort" would
        # reach the client as a truncated answer.
        assert chunks[-1].finish_reason == "suspended" and all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].num_completion_tokens < expected[-1].num_completion_tokens


def test_an_instance_whose_checkpoint_dir_is_gone_after_its_load_still_takes_a_recovery(instances, model_dir,
                                                                                         tmp_path):
    """A restarted node store empties its DRAM tier, where running instances loaded from: an
    instance must not need its model dir once loaded. Its first migration call (here a recovery)
    used to read the checkpoint's identity from the dir then, and failed with FileNotFoundError
    (issue 44's chaos failure: a worker and the controller killed after the node store was)."""
    import shutil

    copy = tmp_path / "dram-tier-copy"
    shutil.copytree(model_dir, copy)
    survivor = start("inst-dirless", copy)
    ray.get(survivor.ready.remote(), timeout=120)
    shutil.rmtree(copy)
    greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}

    async def resolve(instance_id):
        return survivor

    async def main():
        expected = [c async for c in follow_generation(instances["inst-a"], "whole", PROMPT, greedy, resolve=resolve)]
        sent = [t for c in expected[:10] for t in c.token_ids]  # what the client had when its instance died
        rest = [c async for c in follow_generation(survivor, "recovered-dirless", PROMPT, greedy, resolve=resolve,
                                                   sent_token_ids=sent)]
        return expected, sent, rest

    try:
        expected, sent, rest = asyncio.run(asyncio.wait_for(main(), 120))
        tokens = [t for c in expected for t in c.token_ids]
        assert len(sent) == 10 and rest[-1].finish_reason == "length"
        assert sent + [t for c in rest for t in c.token_ids] == tokens  # greedy: exactly the unbroken output
        assert idle(survivor)
    finally:
        stop_instance_worker(survivor)
