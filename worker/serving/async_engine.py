"""An asyncio face on the engine: ``async for out in engine.generate(prompt, params)``.

The engine is single threaded and its steps are long, blocking tensor work, so it runs on
a dedicated thread that owns it. Callers never touch the engine directly: `generate`
validates the request in the caller (so a bad request raises right there, alone), then
posts it to the engine thread's inbox; the engine thread posts each step's outputs back
to the caller's event loop. Leaving the ``async for`` early — a client that disconnected —
aborts the request on the engine, which frees its KV blocks at once. A caller that must not
tokenize on its loop prepares the request in a thread and passes it to `stream`.

One request's failure ends that request's stream alone (`RequestFailedError`); only a failure of
the engine itself kills the thread, and then every stream ends with `EngineDeadError`, those of the
requests in the failing forward pass marked ``suspect``.

Work that must see the engine between two steps (live migration: export a request, copy its KV
blocks, import one) is posted to the same inbox with `call`, so it runs on the engine thread in
order with everything else and never races a step. A request that enters the engine that way
(an imported one) gets its stream from `open_stream`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from wire import EngineDeadError, InvalidRequestError, RequestFailedError  # defined in wire: its callers' side
from worker.engine.engine import Engine, Prompt
from worker.engine.request_output import RequestOutput
from wire.sampling_params import SamplingParams
from worker.engine.sequence import Sequence
from worker.serving.step_turns import StepTurns

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: Engine, *, step_turns: StepTurns | None = None, step_priority: int = 0) -> None:
        """`step_turns`: the turns at stepping this engine shares with the others of its process
        (a slot host's; `worker.serving.step_turns`), asked for with `step_priority` before each step."""
        self.engine = engine
        self._turns = step_turns
        self._priority = step_priority
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams between the caller loops and the engine thread
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="thaw-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; raises `InvalidRequestError` before the first one for bad input.
        Tokenizes on the caller's thread: a caller on an event loop with long prompts should
        `Engine.prepare_request` in a worker thread and use `stream` (as `InstanceWorker` does)."""
        self._check_alive()
        seq = self.engine.prepare_request(prompt, params, request_id)
        async with contextlib.aclosing(self.stream(seq)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of a request prepared by `Engine.prepare_request` (validated and
        tokenized already). A request that fails alone (`Engine`'s finish reason "error") raises
        `RequestFailedError`; if the engine dies, `EngineDeadError`."""
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if seq.request_id in self._streams:
                raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
            self._streams[seq.request_id] = stream
        self._inbox.put(("add", seq))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(("abort", seq.request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between two steps; returns what it returns or
        raises what it raises. Raises `EngineDeadError` if the engine thread has stopped."""
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, done)))
        if not self._thread.is_alive():  # stopped while we posted: nobody will ever run it
            self._fail_calls(EngineDeadError("engine is shut down"))
        return await asyncio.wrap_future(done)

    def deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Posts outputs made outside `Engine.step` (by a `call`) to their streams, in order after
        every output already posted. Safe from any thread; the engine thread is the one to use."""
        self._deliver(list(outputs))

    def open_stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Registers a stream for a request that enters the engine some other way than `generate`
        (an imported one), at once: outputs posted from now on are kept until they are read.
        Returns the stream; leaving it early aborts the request, as with `generate`."""
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        return self._read_stream(request_id, stream)

    async def _read_stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                with self._lock:  # the request may never have reached the engine: free its id here
                    if self._streams.get(request_id) is stream:
                        del self._streams[request_id]
                self._inbox.put(("abort", request_id))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error!r}")
        if self._stopped.is_set():
            raise EngineDeadError("engine is shut down")

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has stopped, by `shutdown` or by an error (see `error`)."""
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def error(self) -> BaseException | None:
        """What killed the engine thread, if it died; None while healthy or after a clean stop."""
        return self._error

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the engine thread; requests still open end with `EngineDeadError`."""
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout_s)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                # Block for work when idle with nothing left to pack; otherwise just drain what
                # arrived during the step (or the layer's packing).
                block = not self.engine.has_unfinished_requests() and not self.engine.weights_to_pack
                self._drain_inbox(block)
                if self.engine.has_unfinished_requests():
                    if self._turns is None:
                        outputs = self.engine.step()
                    else:
                        with self._turns.turn(self._priority):
                            outputs = self.engine.step()
                    self._deliver(outputs)
                # Deferred weight packing (`worker.models.weight_packing`): a layer at a time, after the
                # step's tokens went out, never while a request waits for its first token.
                self.engine.pack_weights_when_free()
        except BaseException as exc:  # noqa: BLE001 - every open stream must hear about it
            suspects = set(self.engine.request_ids_in_step)
            logger.exception("engine thread died (requests in the failing step: %s)", sorted(suspects) or "none")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine stopped: {exc!r}"), suspects)
            self._fail_calls(EngineDeadError(f"engine stopped: {exc!r}"))
            return
        # Clean stop: nobody may wait forever on a request the engine will never step again.
        self._fail_all(EngineDeadError("engine is shut down"))
        self._fail_calls(EngineDeadError("engine is shut down"))

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                out = self.engine.abort(payload)
                if out is not None:
                    self._deliver([out])
            elif kind == "call":
                fn, done = payload
                if not done.set_running_or_notify_cancel():
                    continue  # the caller gave up waiting before it ran: do not run it at all
                try:
                    done.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's
                    done.set_exception(exc)
            elif kind == "stop":
                return

    def _add(self, seq: Sequence) -> None:
        try:
            self.engine.enqueue(seq)
        except ValueError as exc:  # InvalidRequestError: the id is taken
            self._post(seq.request_id, exc, final=True)
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the engine's
            logger.error("request %s failed at admission: %s: %s", seq.request_id, type(exc).__name__, exc)
            self._post(seq.request_id, RequestFailedError(f"admission failed: {type(exc).__name__}: {exc}"),
                       final=True)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error is not None:  # this request alone failed: its stream raises, the others go on
                self._post(out.request_id, RequestFailedError(out.error), final=True)
            else:
                self._post(out.request_id, out, final=out.finished)

    def _post(self, request_id: str, item, final: bool) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if stream is not None:
            _post_to_loop(stream, item)

    def _fail_calls(self, exc: BaseException) -> None:
        """Answers every `call` still in the inbox (the engine thread is gone; other items are moot)."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call" and payload[1].set_running_or_notify_cancel():
                payload[1].set_exception(exc)

    def _fail_all(self, exc: EngineDeadError, suspects: set[str] = frozenset()) -> None:
        """Ends every open stream with `exc`; those of `suspects` with a copy marked ``suspect``."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            _post_to_loop(stream, EngineDeadError(str(exc), suspect=True) if request_id in suspects else exc)


def _post_to_loop(stream: _Stream, item) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass
