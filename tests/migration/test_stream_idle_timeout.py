"""The idle timeout of a client's stream, without Ray: a stream that goes quiet ends with
`StreamIdleTimeout` (and is closed, which cancels its request) unless its instance shows the
request queued, loading or moving; a quiet stream that does show it is waited for."""

from __future__ import annotations

import asyncio

import pytest

from migration import StreamIdleTimeout
from migration.stream_idle_timeout import guard_idle, is_progressing
from worker import RequestProgress, RequestState

IDLE_TIMEOUT_S = 0.4  # probes every 0.1 s
DEADLINE_S = 30  # a guard so a bug fails the test instead of hanging it


def progress(state: RequestState, num_tokens: int = 10, num_computed_tokens: int = 9) -> RequestProgress:
    return RequestProgress("r", state, num_tokens, num_computed_tokens)


RUNNING = progress(RequestState.RUNNING)


@pytest.mark.parametrize("previous,current,expected", [
    (None, progress(RequestState.QUEUED), True),
    (None, progress(RequestState.LOADING), True),
    (None, RUNNING, False),  # a first answer shows no movement
    (RUNNING, RUNNING, False),
    (RUNNING, progress(RequestState.RUNNING, 10, 10), True),  # a prefill chunk computed
    (RUNNING, progress(RequestState.RUNNING, 11, 9), True),  # a token sampled
    (RUNNING, progress(RequestState.FROZEN), True),  # it changed state: something happened
    (progress(RequestState.FROZEN), progress(RequestState.FROZEN), False),
    (RUNNING, progress(RequestState.UNKNOWN), False),
    (RUNNING, None, False),  # no answer
])
def test_what_counts_as_progress(previous, current, expected):
    assert is_progressing(previous, current) is expected


class QuietStream:
    """Yields ``head``, then waits for ``resume`` (never set: quiet for ever), then yields ``tail``;
    records whether it was closed."""

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self.head, self.tail = head, tail
        self.resume = asyncio.Event()
        self.closed = False

    async def chunks(self):
        try:
            for chunk in self.head:
                yield chunk
            await self.resume.wait()
            for chunk in self.tail:
                yield chunk
        finally:
            self.closed = True


class Probe:
    """Answers with ``answers(n)`` for the n-th probe (from 1); once ``resume_after`` probes were
    answered, lets the stream go on."""

    def __init__(self, answers, stream: QuietStream | None = None, resume_after: int | None = None) -> None:
        self.answers = answers
        self.stream = stream
        self.resume_after = resume_after
        self.num_probes = 0

    async def __call__(self) -> RequestProgress:
        self.num_probes += 1
        if self.stream is not None and self.num_probes == self.resume_after:
            self.stream.resume.set()
        return self.answers(self.num_probes)


async def read(stream: QuietStream, probe) -> list[int]:
    received = []
    async for chunk in guard_idle(stream.chunks(), probe, request_id="r", idle_timeout_s=IDLE_TIMEOUT_S):
        received.append(chunk)
    return received


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


@pytest.mark.parametrize("answer,last_state", [
    (lambda n: progress(RequestState.FROZEN), RequestState.FROZEN),  # frozen by a driver that went away
    (lambda n: RUNNING, RequestState.RUNNING),  # "running", yet nothing moves: a hung step
    (lambda n: progress(RequestState.UNKNOWN), RequestState.UNKNOWN),  # the instance lost it
])
def test_a_quiet_stream_with_no_progress_times_out_and_is_closed(answer, last_state):
    stream = QuietStream([1, 2], [3])
    received = []

    async def main():
        async for chunk in guard_idle(stream.chunks(), Probe(answer), request_id="r", idle_timeout_s=IDLE_TIMEOUT_S):
            received.append(chunk)

    with pytest.raises(StreamIdleTimeout, match=rf"request 'r' sent nothing for [0-9.]+ s and its instance says it "
                                                rf"is {last_state.value}; it was cancelled there") as raised:
        run(main())
    assert received == [1, 2]  # everything before the silence arrived
    assert raised.value.last_state is last_state and raised.value.idle_s >= IDLE_TIMEOUT_S
    assert stream.closed  # closing the instance's stream is what cancels the request there


def test_an_instance_that_does_not_answer_times_out_too():
    async def failing_probe():
        raise ConnectionError("actor died")

    stream = QuietStream([1], [2])
    with pytest.raises(StreamIdleTimeout, match="its instance did not answer") as raised:
        run(read(stream, failing_probe))
    assert raised.value.last_state is None and stream.closed


@pytest.mark.parametrize("answers", [
    lambda n: progress(RequestState.QUEUED),  # waiting for KV blocks
    lambda n: progress(RequestState.LOADING),  # its instance is loading the model
    lambda n: progress(RequestState.RUNNING, 100, 4 * n),  # a long prompt prefilled chunk by chunk
])
def test_a_quiet_stream_whose_request_waits_or_progresses_is_waited_for(answers):
    stream = QuietStream([1, 2], [3, 4])
    # Resumed after 12 probes: three times the idle timeout of silence, which must not end it.
    probe = Probe(answers, stream, resume_after=12)
    assert run(read(stream, probe)) == [1, 2, 3, 4]
    assert probe.num_probes == 12


def test_chunks_that_keep_coming_need_no_probe():
    async def steady():
        for chunk in range(5):
            yield chunk

    probe = Probe(lambda n: progress(RequestState.UNKNOWN))
    assert run(read_any(steady(), probe)) == [0, 1, 2, 3, 4]
    assert probe.num_probes == 0


async def read_any(chunks, probe) -> list[int]:
    return [chunk async for chunk in guard_idle(chunks, probe, request_id="r", idle_timeout_s=IDLE_TIMEOUT_S)]


def test_the_timeout_is_validated():
    async def main():
        async for _ in guard_idle(QuietStream([], []).chunks(), Probe(lambda n: RUNNING), request_id="r",
                                  idle_timeout_s=0):
            pass

    with pytest.raises(ValueError, match="idle_timeout_s must be a finite number of seconds > 0, got 0"):
        run(main())
