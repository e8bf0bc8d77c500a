"""Every wire record through a real Ray actor call, and `wire.call` / `wire.stream` against a real
actor: its errors (ours, a library's, its death) and a stream left early.

One tiny Ray for the module (one CPU, no dashboard), shut down after; the echo actor reserves no
CPU. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import ray

from controller import UnknownModelError
from wire import (ActorGoneError, GenerationChunk, InstanceLoad, InstanceLoadRecord, InstanceRoute, InstanceState,
                  InstanceStats, ModelRecord, SamplingParams, call, stream)
from wire import MigrationMethod, MigrationOutcome, MigrationStatus, RequestSnapshot

DEADLINE_S = 60.0
RECORDS = [
    SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], stop_token_ids=[2], seed=9),
    GenerationChunk(request_id="r1", text="héllo", token_ids=(5, 6), finish_reason="length", num_prompt_tokens=3,
                    num_completion_tokens=2, queue_s=0.5),
    InstanceRoute("i1", "thaw-worker-i1", "thaw", "node0", 4),
    InstanceLoadRecord(instance_id="i1", tier="dram", load_s=0.25),
    ModelRecord(model_id="acme/m1", deployed_s=1_700_000_123.5, max_model_len=None, max_queued_requests=7,
                queue_timeout_s=3.0, instances=(InstanceLoadRecord(instance_id="i1", tier=None, load_s=None),)),
    InstanceLoad(instance_id="i1", model_id="acme/m1", model_dir="/nodes/n0/dram/m1", load_s=1.25, weights_load_s=None,
                 weights_read="layer by layer", num_kv_blocks=64, block_size=16, max_model_len=2048),
    InstanceStats(instance_id="i1", model_id="acme/m1", state=InstanceState.READY, num_ongoing_requests=3,
                  num_waiting_requests=1, num_running_requests=2, num_free_kv_blocks=48, num_kv_blocks=64,
                  num_generated_tokens=120, started_at=1_700_000_000.5, load_s=1.25, weights_read="",
                  weights_resident=False, prefills_at_frontier=("r1",), pid=4242),
    RequestSnapshot("r1", tuple(range(4000)), (7, 8), SamplingParams(max_tokens=9, seed=3), 4001,
                    bytes(range(256)) * 20, "cpu", "ckpt-00000000000000v1"),
    MigrationOutcome("r1", MigrationMethod.KV, MigrationStatus.REFUSED, "i1", "i2", 2, 40, 1, 3, 3072, 0.25, 1.5,
                     error="0 free KV blocks"),
]


class ThirdPartyError(Exception):
    """Stands for a library's exception (its module is not one of thaw's packages)."""


class Echo:
    """Sends back what it is given, fails on demand, and streams chunks."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.any_cancelled = asyncio.Event()

    def echo(self, value):
        return value

    def fail(self, kind: str):
        if kind == "ours":
            raise UnknownModelError("acme/gone")
        if kind == "builtin":
            raise LookupError("no node 'n9'")
        raise ThirdPartyError("a library failed")

    def die(self):
        os._exit(1)

    async def count(self, request_id: str, num_chunks: int, fail_at: int = -1):
        try:
            for i in range(num_chunks):
                if i == fail_at:
                    raise ValueError(f"chunk {i} cannot be made")
                yield GenerationChunk(request_id=request_id, text=f"t{i}", token_ids=(i,),
                                      finish_reason="length" if i == num_chunks - 1 else None,
                                      num_prompt_tokens=1, num_completion_tokens=i + 1)
                await asyncio.sleep(0.01 if i < 2 else 3600)  # past two chunks, only a cancel ends it
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            self.any_cancelled.set()
            raise

    async def cancelled_ids(self) -> list[str]:
        """The streams cancelled so far, once there is one."""
        await self.any_cancelled.wait()
        return list(self.cancelled)


@pytest.fixture(scope="module")
def local_ray():
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started_here:
        ray.shutdown()


@pytest.fixture()
def echo(local_ray):
    handle = ray.remote(Echo).options(num_cpus=0, max_restarts=0).remote()
    yield handle
    ray.kill(handle, no_restart=True)


def test_every_record_round_trips_through_a_real_actor_call(echo):
    async def main():
        return ([await call(echo.echo.remote(record), DEADLINE_S) for record in RECORDS],
                [await call(echo.echo.remote(record.to_dict()), DEADLINE_S) for record in RECORDS])

    objects, dicts = asyncio.run(main())
    assert objects == RECORDS and [type(o) for o in objects] == [type(r) for r in RECORDS]
    assert [type(r).from_dict(d) for r, d in zip(RECORDS, dicts)] == RECORDS


def test_our_errors_come_back_as_themselves_and_a_librarys_in_rays_wrapper(echo):
    async def main():
        with pytest.raises(UnknownModelError) as ours:
            await call(echo.fail.remote("ours"), DEADLINE_S)
        with pytest.raises(LookupError) as builtin:
            await call(echo.fail.remote("builtin"), DEADLINE_S)
        with pytest.raises(ThirdPartyError) as foreign:
            await call(echo.fail.remote("foreign"), DEADLINE_S)
        return ours.value, builtin.value, foreign.value

    ours, builtin, foreign = asyncio.run(main())
    assert type(ours) is UnknownModelError and ours.model_id == "acme/gone"
    assert isinstance(ours.__cause__, ray.exceptions.RayTaskError)
    assert type(builtin) is LookupError and str(builtin) == "no node 'n9'"
    assert isinstance(foreign, ray.exceptions.RayTaskError)  # Ray's dual type: still a ThirdPartyError


def test_a_stream_yields_every_chunk_and_an_error_midway_as_ours(echo):
    async def main():
        whole = [c async for c in stream(echo.count.options(num_returns="streaming").remote("r", 2),
                                         is_last=lambda c: c.finished)]
        partial = []
        with pytest.raises(ValueError, match="chunk 1 cannot be made"):
            async for chunk in stream(echo.count.options(num_returns="streaming").remote("bad", 3, 1)):
                partial.append(chunk)
        return whole, partial

    whole, partial = asyncio.run(main())
    assert [(c.token_ids, c.finish_reason, c.num_completion_tokens) for c in whole] == [((0,), None, 1),
                                                                                        ((1,), "length", 2)]
    assert [c.token_ids for c in partial] == [(0,)]


def test_leaving_a_stream_early_cancels_it_on_the_actor(echo):
    async def main():
        chunks = stream(echo.count.options(num_returns="streaming").remote("leaver", 10))
        async with contextlib.aclosing(chunks):
            taken = [await chunks.__anext__() for _ in range(3)]  # the third is followed by a long wait
        try:
            return taken, await call(echo.cancelled_ids.remote(), DEADLINE_S)
        except TimeoutError:
            pytest.fail(f"the actor's stream was not cancelled within {DEADLINE_S} s")

    taken, cancelled = asyncio.run(main())
    assert [c.token_ids for c in taken] == [(0,), (1,), (2,)]
    assert cancelled == ["leaver"]


def test_a_dead_actor_is_actor_gone_for_calls_and_streams(local_ray):
    handle = ray.remote(Echo).options(num_cpus=0, max_restarts=0).remote()

    async def main():
        assert await call(handle.echo.remote(1), DEADLINE_S) == 1
        with pytest.raises(ActorGoneError):
            await call(handle.die.remote(), DEADLINE_S)
        with pytest.raises(ActorGoneError):
            await call(handle.echo.remote(2), DEADLINE_S)
        with pytest.raises(ActorGoneError):
            async for _ in stream(handle.count.options(num_returns="streaming").remote("late", 2)):
                pass

    try:
        asyncio.run(main())
    finally:
        ray.kill(handle, no_restart=True)
