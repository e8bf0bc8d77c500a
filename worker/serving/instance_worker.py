"""One model instance: a model loaded into an engine, serving streams of tokens to the gateway.

`InstanceWorker` is the body of the Ray actor that hosts a model instance (see
`instance_worker_actor.py`, which only forwards to it), written as a plain class so it is tested
without Ray. It owns one `AsyncEngine`; continuous batching happens there, so any number of
concurrent ``generate`` streams share each forward pass.

Loading starts in the constructor, on a thread of its own: the actor exists (and answers
``health()`` / ``stats()``) while the weights are read, requests that arrive meanwhile wait for
the model instead of failing, and a load that fails is reported by ``ready()`` — and by every
``generate`` — as an `InstanceLoadError` naming the model, the dir and the cause, instead of an
actor that dies in its constructor or hangs.

`suspend` ends every stream with finish reason "suspended" when the slot is preempted for another
model, and `shutdown` does the same when the instance stops; the gateway continues those requests
on the model's next instance.

Requests are validated before they touch the engine and refused with `InvalidFieldError`, which
names the offending field (OpenAI's error ``param``) so the gateway answers 400 pointing at it.
The prompt is tokenized once, in a worker thread (an 8 MiB prompt must not stall the other
streams on the actor's event loop); which check failed tells which field is at fault, so no
error message is ever parsed. A request that fails alone inside the engine (its sampling, stop
handling or detokenizing) raises `RequestFailedError` from its stream; the instance goes on.

All methods run on one asyncio event loop (the actor's); only the load thread and the engine
thread run beside it, and they hand results over through futures and `AsyncEngine`'s queues.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

from loader import StreamConfig
from worker.serving.async_engine import AsyncEngine, EngineDeadError
from worker.engine.engine import Engine, InvalidRequestError, Prompt
from worker.engine.engine_config import EngineConfig
from worker.loading.host_allocator import release_free_memory
from worker.loading.peer_weights import PeerWeights, PeerWeightsReceiver, WeightStreams
from worker.loading.reserved_memory import ReservedMemory
from wire.sampling_params import SamplingParams
from worker.engine.sequence import Sequence
from worker.serving.step_turns import StepTurns
from wire import ChatPrompt  # a chat with its tools and template arguments (wire/)
from wire import FinishReason, GenerationChunk  # one chunk record and finish reason for worker and gateway (wire/)
from wire import InstanceLoad, InstanceState, InstanceStats  # its reports to the controller (wire/)

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_ENGINE_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


class InvalidFieldError(InvalidRequestError):
    """A request refused because of one of its fields; ``field`` names it, ``message`` says why.

    Pickles with both (an exception normally pickles only its args), so it reaches the gateway
    intact across a Ray call.
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __reduce__(self):
        return type(self), (self.message, self.field)


class InstanceLoadError(RuntimeError):
    """The instance could not load its model; the message names the model, the dir and the cause."""


class SourceUnavailableError(RuntimeError):
    """This instance cannot stream its weights to another now (loading, failed, or no local copy)."""


class InstanceBusyError(RuntimeError):
    """The instance cannot sleep now: a request is open, or it is not ready."""


def as_engine_config(value: EngineConfig | Mapping[str, Any] | None) -> EngineConfig:
    """An `EngineConfig` from itself, a mapping of its fields (e.g. a model spec's), or None
    (defaults). Raises `ValueError` naming an unknown or invalid field."""
    if value is None:
        return EngineConfig()
    if isinstance(value, EngineConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"engine config must be an EngineConfig or a mapping, got {type(value).__name__}")
    unknown = [key for key in value if key not in _ENGINE_CONFIG_FIELDS]
    if unknown:
        raise ValueError(
            f"unknown engine config field {unknown[0]!r}; known fields: {', '.join(_ENGINE_CONFIG_FIELDS)}"
        )
    return EngineConfig(**value)


def as_sampling_params(value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """`SamplingParams` from a mapping of its fields; raises `InvalidFieldError` naming the field."""
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise InvalidFieldError(
            f"sampling parameters must be a mapping of field names to values, got {type(value).__name__}",
            field="sampling_params",
        )
    unknown = [key for key in value if key not in _SAMPLING_FIELDS]
    if unknown:
        raise InvalidFieldError(
            f"unknown sampling parameter {unknown[0]!r}; known: {', '.join(_SAMPLING_FIELDS)}", field=str(unknown[0])
        )
    try:
        return SamplingParams(**value)
    except ValueError as exc:
        raise InvalidFieldError(str(exc), field=_failing_sampling_field(value)) from exc


def _failing_sampling_field(value: Mapping[str, Any]) -> str:
    """The first field that `SamplingParams` refuses on its own. Every one of its checks looks at
    a single field, so trying them one by one finds the culprit without reading the message."""
    for name, item in value.items():
        try:
            SamplingParams(**{name: item})
        except ValueError:
            return name
    return "sampling_params"


class InstanceWorker:
    """A model instance: loads ``model_dir`` into an engine and streams generations from it."""

    def __init__(self, instance_id: str, model_id: str, model_dir: str | Path | None,
                 engine_config: EngineConfig | Mapping[str, Any] | None = None, *,
                 reserved: ReservedMemory | None = None, peer: PeerWeights | None = None,
                 step_turns: StepTurns | None = None, step_priority: int = 0) -> None:
        """`reserved`: memory faulted ahead of the load by a spare worker (see `worker.loading.reserved_memory`).
        `peer`: take the weights from a running instance's stream instead of reading `model_dir`
        (`worker.loading.peer_weights`); the instance is ready as soon as its engine exists and serves while
        the layers land. `model_dir` is then the node's copy of the checkpoint if it is already in
        place, else None and `supply_fallback` gives it later (the stream's fallback). `step_turns`
        / `step_priority`: the engine takes turns at stepping with the other models of its slot host
        (`worker.serving.step_turns`)."""
        self.instance_id = instance_id
        self._reserved = reserved
        self._step_turns, self._step_priority = step_turns, step_priority
        self.model_id = model_id
        self.engine_config = as_engine_config(engine_config)
        self._streams = WeightStreams(instance_id, model_id)
        self._peer: PeerWeightsReceiver | None = None
        if peer is not None:
            if peer.model_id != model_id:
                raise ValueError(f"the stream from instance {peer.source_instance_id} carries {peer.model_id!r}, "
                                 f"not {model_id!r}")
            self._peer = PeerWeightsReceiver(peer, fallback_timeout_s=self.engine_config.layer_timeout_s)
            if model_dir is not None:
                self._peer.supply_fallback(str(model_dir))
            self.model_dir = self._peer.model_dir
        elif model_dir is None:
            raise ValueError("an instance needs a model_dir, or a peer to stream its weights from")
        else:
            self.model_dir = Path(model_dir)
        self.started_at = time.time()
        # RUNNING from the start, so that a cancelled waiter (a generate cancelled during the load)
        # cannot cancel the load itself through asyncio.wrap_future.
        self._loaded: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()
        self._loaded.set_running_or_notify_cancel()
        self._load: InstanceLoad | None = None
        self._open_streams: dict[str, asyncio.Future[None]] = {}  # request id -> resolved when it closes
        self._num_generated_tokens = 0
        self._num_requests_started = 0
        self._suspending = False  # set by `suspend`: every stream, open or new, ends "suspended"
        self._suspended: set[str] = set()
        self._engine_error: EngineDeadError | None = None
        self._stopped = False
        self._asleep = False  # `sleep`: the engine asleep (KV pool freed); requests are refused until `wake`
        threading.Thread(target=self._load_engine, name=f"thaw-load-{instance_id}", daemon=True).start()

    # ---- lifecycle -------------------------------------------------------------------------

    def _load_engine(self) -> None:
        start = time.perf_counter()
        try:
            weights = None
            if self._peer is not None:
                self._peer.start()
                weights = self._peer.layers
            engine = Engine(self.model_dir, self.engine_config, reserved=self._reserved, weights=weights)
            self._reserved = None  # what the engine did not take goes with this reference
            async_engine = AsyncEngine(engine, step_turns=self._step_turns, step_priority=self._step_priority)
        except BaseException as exc:  # noqa: BLE001 - whatever it was, ready() must report it, not hang
            logger.exception("instance %s: loading %s failed", self.instance_id, self.model_id)
            self._loaded.set_exception(InstanceLoadError(
                f"instance {self.instance_id} could not load model {self.model_id!r} from {self.model_dir}: "
                f"{type(exc).__name__}: {exc}"
            ))
            return
        figures = engine.stats()
        self._load = InstanceLoad(
            instance_id=self.instance_id,
            model_id=self.model_id,
            model_dir=str(self.model_dir),
            load_s=time.perf_counter() - start,
            weights_load_s=engine.load_s,
            weights_read=engine.load_report,
            num_kv_blocks=figures.num_kv_blocks,
            block_size=figures.block_size,
            max_model_len=engine.max_model_len,
            weights_pack_s=engine.packing.load_s if engine.packing is not None else 0.0,
        )
        logger.info("instance %s: %s ready in %.2f s", self.instance_id, self.model_id, self._load.load_s)
        self._loaded.set_result(async_engine)

    async def ready(self) -> InstanceLoad:
        """Waits until the model is loaded; returns how it was loaded. Raises `InstanceLoadError`."""
        await asyncio.wrap_future(self._loaded)
        assert self._load is not None  # set before the future resolves
        return self._load

    @property
    def state(self) -> InstanceState:
        if self._stopped:
            return InstanceState.STOPPED
        if not self._loaded.done():
            return InstanceState.LOADING
        if self._loaded.exception() is not None or self._engine_error is not None:
            return InstanceState.FAILED
        if self._loaded.result().engine.weights_error is not None:
            return InstanceState.FAILED  # its weights can never arrive: replace it
        return InstanceState.ASLEEP if self._asleep else InstanceState.READY

    @property
    def weights_resident(self) -> bool:
        """Whether every layer of the model is in (False while a peer's stream still delivers them)."""
        if not self._loaded.done() or self._loaded.exception() is not None:
            return False
        return self._loaded.result().engine.weights_resident

    @property
    def checkpoint_dir(self) -> Path | None:
        """The node's copy of the checkpoint this instance serves from (None: a peer-fed instance
        whose node copy has not been supplied yet)."""
        if self._peer is None:
            return self.model_dir
        supplied = self._peer.fallback_dir
        return Path(supplied) if supplied is not None else None

    # ---- weights for other instances -------------------------------------------------------

    def supply_fallback(self, checkpoint_dir: str) -> None:
        """The node's copy of the checkpoint is in place: the peer stream's fallback, and what this
        instance streams from when it becomes a source itself."""
        if self._peer is None:
            raise ValueError(f"instance {self.instance_id} loaded its weights from {self.model_dir}; "
                             "it has no stream to fall back from")
        self._peer.supply_fallback(checkpoint_dir)

    async def stream_weights(self, num_receivers: int = 1, config: StreamConfig | None = None) -> PeerWeights:
        """Stream this instance's model to `num_receivers` new instances (a chain); returns rank 1's
        ticket (`PeerWeights.for_rank` for the others). Refused while the instance cannot vouch for
        every byte: still loading, failed, or fed by a stream whose node copy has not arrived."""
        if not isinstance(num_receivers, int) or isinstance(num_receivers, bool) or num_receivers < 1:
            raise ValueError(f"num_receivers must be an integer >= 1 (new instances in the chain), "
                             f"got {num_receivers!r}")
        state, resident = self.state, self.weights_resident
        if state is not InstanceState.READY or not resident:
            raise SourceUnavailableError(f"instance {self.instance_id} is {state.value}"
                                         f"{'' if resident else ' with its weights still arriving'}; "
                                         "it cannot stream its model yet")
        checkpoint_dir = self.checkpoint_dir
        if checkpoint_dir is None:
            raise SourceUnavailableError(f"instance {self.instance_id} has no local copy of {self.model_id} yet; "
                                         "it cannot stream its model")
        return await asyncio.to_thread(self._streams.open, checkpoint_dir, num_receivers, config or StreamConfig())

    def health(self) -> InstanceState:
        """The instance's state; never raises, so a probe tells "failed" from "unreachable"."""
        return self.state

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops taking requests, ends the open ones' streams with finish reason "suspended" (as
        `suspend` does) and stops the engine thread. Idempotent.

        "Suspended", not "abort": the instance goes away through no fault of its requests, so the
        gateway continues each on its model's next instance from the tokens its client has. A
        stop can race a request the controller's drain did not see yet (routed just before the
        instance left the routing table, or still being tokenized); that request must lose
        nothing either. A request that arrives once the instance is stopped gets `EngineDeadError`
        before any token, which the gateway retries elsewhere.

        Waits up to ``timeout_s`` for the open streams to close, which needs their readers to keep
        reading — Ray does, in the actor; a plain caller must not await this from its only reader.
        """
        if self._stopped:
            return
        self._stopped = True
        await asyncio.to_thread(self._streams.close)
        try:
            async_engine = await asyncio.wrap_future(self._loaded)
        except InstanceLoadError:
            if self._peer is not None:
                await asyncio.to_thread(self._peer.close)
            return
        # Ends the streams first, and waits for them to close: AsyncEngine.shutdown stops its
        # thread without answering open streams, which would leave their callers waiting forever.
        self.suspend()
        closing = list(self._open_streams.values())
        if closing:
            await asyncio.wait(closing, timeout=timeout_s)
        await asyncio.to_thread(async_engine.shutdown, timeout_s)
        if self._peer is not None:
            await asyncio.to_thread(self._peer.close)

    # ---- sleep -----------------------------------------------------------------------------

    async def sleep(self) -> int:
        """Puts an idle instance to sleep: its engine frees the KV pool, and where the engine's
        sleep frees its weights (`Engine.sleep_frees_weights`: on a GPU) moves them to pinned host
        memory; otherwise it keeps them (on CPU, packed: waking skips the load and the packing a
        restart pays). From now on a request is refused with `EngineDeadError` before any token,
        which the gateway retries on another instance or queues for the controller to wake this
        one. Refused (`InstanceBusyError`) while a request is open or the instance is not ready.
        Returns the device bytes freed (the pool's, and the weights' where they moved)."""
        if self._asleep:
            return 0
        state = self.state
        if state is not InstanceState.READY or self._open_streams:
            raise InstanceBusyError(f"instance {self.instance_id} is {state.value} with "
                                    f"{len(self._open_streams)} open request(s); it cannot sleep")
        self._asleep = True  # before the engine call: a request arriving meanwhile is refused here
        async_engine = self._loaded.result()
        try:
            freed = await async_engine.call(lambda engine: engine.sleep())
        except BaseException:
            self._asleep = False
            raise
        await asyncio.to_thread(release_free_memory)  # the pool's pages back to the kernel, not this heap's
        moved = async_engine.engine.host_weights
        if moved is None:
            logger.info("instance %s asleep: %.3f GB freed (its KV pool), weights kept in place",
                        self.instance_id, freed / 1e9)
        else:
            logger.info("instance %s asleep: %.3f GB freed on %s; weights (%.3f GB) moved to %s host memory in "
                        "%.3f s (%.2f GB/s)", self.instance_id, freed / 1e9, async_engine.engine.device,
                        moved.num_bytes / 1e9, "pinned" if moved.pin_memory else "pageable", moved.offload_s,
                        _gb_per_s(moved.num_bytes, moved.offload_s))
        return freed

    async def wake(self) -> None:
        """Wakes a sleeping instance: weights its sleep moved to host memory are copied back, the
        KV pool is rebuilt; it serves again. At once if awake."""
        if not self._asleep:
            return
        async_engine = self._loaded.result()
        start_s = time.perf_counter()
        await async_engine.call(lambda engine: engine.wake())
        self._asleep = False
        moved = async_engine.engine.host_weights
        if moved is None:
            logger.info("instance %s awake: KV pool rebuilt in %.3f s", self.instance_id,
                        time.perf_counter() - start_s)
        else:
            logger.info("instance %s awake in %.3f s: weights (%.3f GB) copied back to %s in %.3f s (%.2f GB/s), "
                        "KV pool rebuilt", self.instance_id, time.perf_counter() - start_s, moved.num_bytes / 1e9,
                        async_engine.engine.device, moved.restore_s, _gb_per_s(moved.num_bytes, moved.restore_s))

    # ---- requests --------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: Prompt,
                       sampling_params: SamplingParams | Mapping[str, Any] | None = None
                       ) -> AsyncIterator[GenerationChunk]:
        """Streams one request's chunks; the last one has ``finish_reason`` and the usage.

        ``prompt`` is a string, a list of token ids, or a list of chat messages (rendered with the
        model's chat template). Raises before the first chunk: `InvalidFieldError` for a bad
        request, `InstanceLoadError` if the model could not be loaded, `EngineDeadError` if the
        instance is shut down or its engine failed; mid-stream, `RequestFailedError` if this
        request alone failed in the engine (the instance serves on), `EngineDeadError` if the engine died. Leaving early (``aclose``, or the task being
        cancelled, which is what ``ray.cancel`` does) aborts the request and frees its KV blocks.
        """
        async_engine = await self.serving_engine()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidFieldError(f"request_id must be a non-empty string, got {request_id!r}", field="request_id")
        if request_id in self._open_streams:
            raise InvalidFieldError(f"request id {request_id!r} is already in use", field="request_id")
        params = as_sampling_params(sampling_params)
        # Off the event loop: a long prompt's tokenizing must not stall every other stream here.
        seq = await asyncio.to_thread(_validated_request, async_engine.engine, request_id, prompt, params)
        if request_id in self._open_streams:  # taken while it was tokenized
            raise InvalidFieldError(f"request id {request_id!r} is already in use", field="request_id")
        if self._asleep:  # routed here just before it slept: the gateway goes elsewhere (or waits)
            raise EngineDeadError(f"instance {self.instance_id} is asleep")
        if self._suspending:  # routed here just before the suspension: it waits for the next slot too
            yield GenerationChunk(request_id=request_id, text="", token_ids=(), finish_reason=FinishReason.SUSPENDED.value,
                                  num_prompt_tokens=seq.num_prompt_tokens, num_completion_tokens=0)
            return
        closed = asyncio.get_running_loop().create_future()
        self._open_streams[request_id] = closed
        self._num_requests_started += 1
        try:
            outputs = async_engine.stream(seq)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    self._num_generated_tokens += len(out.new_token_ids)
                    yield GenerationChunk(
                        request_id=request_id,
                        text=out.new_text,
                        token_ids=out.new_token_ids,
                        finish_reason=self.finish_reason(request_id, out.finish_reason),
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_completion_tokens=out.num_output_tokens,
                        logprobs=out.logprobs,
                        num_cached_tokens=out.num_cached_tokens,
                    )
        except InvalidRequestError as exc:
            # Prompt and params passed the checks above; what is left is the engine still holding
            # an earlier request under this id (a cancelled one whose abort is in flight).
            raise InvalidFieldError(str(exc), field="request_id") from exc
        except EngineDeadError as exc:
            self._engine_error = exc
            raise
        finally:
            del self._open_streams[request_id]
            closed.set_result(None)

    async def serving_engine(self) -> AsyncEngine:
        """The instance's running engine, once loaded (waits for the load); raises as ``generate``
        does when the load failed (`InstanceLoadError`) or the engine is dead or shut down
        (`EngineDeadError`). For a caller that serves more than ``generate`` from the same
        engine (the migration endpoint of `migration.MigratableInstanceActor`)."""
        async_engine = await asyncio.wrap_future(self._loaded)
        if self._stopped:
            raise EngineDeadError(f"instance {self.instance_id} is shut down")
        if self._engine_error is not None:
            raise EngineDeadError(f"instance {self.instance_id} failed: {self._engine_error}")
        return async_engine

    def open_request_ids(self) -> list[str]:
        """The requests whose ``generate`` stream is open here, sorted."""
        return sorted(self._open_streams)

    def suspend(self, other_request_ids: Iterable[str] = ()) -> list[str]:
        """Ends every open request's stream with finish reason "suspended" (`FinishReason.SUSPENDED`), and
        every stream opened from now on at once: the caller (the gateway) queues them for their
        model's next instance, which continues each from the tokens its client received.
        `other_request_ids`: requests this engine runs whose streams are not this class's (taken
        in by migration); they are aborted and reported "suspended" by `finish_reason` too.
        Returns the ids suspended. Used when the slot is preempted for another model, and by
        `shutdown`."""
        self._suspending = True
        request_ids = sorted(set(self._open_streams) | set(other_request_ids))
        self._suspended.update(request_ids)
        if request_ids:
            async_engine = self._loaded.result()
            for request_id in request_ids:
                async_engine.abort(request_id)
        return request_ids

    def finish_reason(self, request_id: str, engine_reason: str | None) -> str | None:
        """The finish reason a stream reports: the engine's, but "suspended" for a request that
        `suspend` aborted (its abort is not the client's)."""
        if engine_reason == FinishReason.ABORT and request_id in self._suspended:
            return FinishReason.SUSPENDED.value
        return engine_reason

    def abort(self, request_id: str) -> bool:
        """Cancels an open request (its stream ends with "abort"); False if none is open under that id."""
        if request_id not in self._open_streams:  # open streams exist only once the engine is loaded
            return False
        self._loaded.result().abort(request_id)
        return True

    # ---- reporting -------------------------------------------------------------------------

    def stats(self) -> InstanceStats:
        """A snapshot of this instance's load (engine figures are read without stopping it)."""
        engine = None
        if self._loaded.done() and self._loaded.exception() is None:
            engine = self._loaded.result().engine
        figures = engine.stats() if engine else None
        load = self._load
        return InstanceStats(
            instance_id=self.instance_id,
            model_id=self.model_id,
            state=self.state,
            num_ongoing_requests=len(self._open_streams),
            num_waiting_requests=figures.num_waiting_requests if figures else 0,
            num_running_requests=figures.num_running_requests if figures else 0,
            num_free_kv_blocks=figures.num_free_kv_blocks if figures else 0,
            num_kv_blocks=figures.num_kv_blocks if figures else 0,
            num_generated_tokens=self._num_generated_tokens,
            started_at=self.started_at,
            load_s=load.load_s if load else 0.0,
            weights_read=self._weights_read(engine),
            weights_resident=self.weights_resident,
            num_weight_streams=self._streams.num_active,
            prefills_at_frontier=tuple(engine.movable_prefill_ids()) if engine else (),
            num_requests_started=self._num_requests_started,
            pid=os.getpid(),
            num_prefix_cache_queried_tokens=figures.num_prefix_cache_queried_tokens if figures else 0,
            num_prefix_cache_hit_tokens=figures.num_prefix_cache_hit_tokens if figures else 0,
        )

    def _weights_read(self, engine: Engine | None) -> str:
        if engine is None:
            return ""
        return engine.load_report if self._peer is None else f"{engine.load_report}; {self._peer.describe()}"

    def __repr__(self) -> str:
        return f"InstanceWorker({self.instance_id!r}, model={self.model_id!r}, state={self.state.value})"


def _validated_request(engine: Engine, request_id: str, prompt: Prompt, params: SamplingParams) -> Sequence:
    """Tokenizes the prompt once and runs the engine's admission checks, blaming the right field:
    the prompt alone (`Engine.tokenize_prompt`) is the prompt's (or the messages') fault, the
    prompt with the request's ``max_tokens`` (`Engine.prepare_tokens`) is ``max_tokens``'s, a
    ``logit_bias`` token outside the vocabulary (`Engine.check_params`) is ``logit_bias``'s, a
    ``structured_output`` the model cannot enforce (`Engine.check_structured_output`, which compiles
    it) is ``structured_output``'s. Touches no engine state, so it runs in a worker thread."""
    is_chat = isinstance(prompt, ChatPrompt) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict))
    prompt_field = "messages" if is_chat else "prompt"
    try:
        prompt_ids = engine.tokenize_prompt(prompt)
    except InvalidRequestError as exc:
        raise InvalidFieldError(str(exc), field=prompt_field) from exc
    try:
        engine.check_structured_output(params)
    except InvalidRequestError as exc:
        raise InvalidFieldError(str(exc), field="structured_output") from exc
    try:
        engine.check_params(params)
    except InvalidRequestError as exc:  # a logit_bias token outside the vocabulary
        raise InvalidFieldError(str(exc), field="logit_bias") from exc
    try:
        return engine.prepare_tokens(prompt_ids, params, request_id)
    except InvalidRequestError as exc:
        raise InvalidFieldError(str(exc), field="max_tokens") from exc


def _gb_per_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / 1e9 / seconds if seconds > 0 else 0.0
