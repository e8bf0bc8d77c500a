"""The bookkeeping both migration protocols share: which instance each step ran on, whether the
source has stopped the request, what it cost, and how to undo everything when a step fails.

Abort safety lives here, once. Whatever step fails, the undo is the same: drop the import on the
destination (which frees every block it reserved; a dead destination has nothing left to free),
and, if the source may have stopped the request, let it carry on. Both are idempotent, so they
are done whenever in doubt (a call whose answer was lost may or may not have happened). What the
failure *means* depends on where it happened: the source not knowing the request means it
finished there first; either side declining (`MigrationRefusedError`: no room, a request that
cannot move yet) is a refusal; anything else is a failure.

The driver's liveness lives here too. What the stop leaves on the source (a frozen request) and
what the handshake leaves on the destination (a paused import) is leased (`migration.lease_book`):
while `drive` runs, a task renews both every ``lease_s / 3``, so a slow step never loses them; if
this process dies, the renewals stop and each instance undoes its side alone within ``lease_s``.
A source whose lease ran out anyway (this driver stalled past it) has resumed the request: the
hand-off is then refused, the copy on the destination cancelled, and the request goes on whole on
its source (``FAILED``, saying so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from migration.kv_transport import KVPayload
from migration.lease_book import DEFAULT_LEASE_S, validate_lease_s
from migration.migration_endpoint import MigrationEndpoint
from wire.migration_outcome import MigrationMethod, MigrationOutcome, MigrationStatus
from worker import MigrationRefusedError, RequestSnapshot, UnknownRequestError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StepFailed(Exception):
    """A protocol step raised; ``on_source`` says on which instance."""

    def __init__(self, on_source: bool, cause: BaseException) -> None:
        super().__init__(f"{'source' if on_source else 'destination'}: {type(cause).__name__}: {cause}")
        self.on_source = on_source
        self.cause = cause


class MigrationAttempt:
    def __init__(self, source: MigrationEndpoint, dest: MigrationEndpoint, request_id: str,
                 method: MigrationMethod, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.source = source
        self.dest = dest
        self.request_id = request_id
        self.method = method
        self.lease_s = validate_lease_s(lease_s)
        self.num_rounds = 0
        self.num_blocks_copied = 0
        self.num_bytes_copied = 0
        self._started_s = time.perf_counter()
        self._stopped_at_s: float | None = None
        self._stop_s = 0.0
        self._final: RequestSnapshot | None = None
        self._num_tokens_after_stop = 0

    async def on_source(self, step: Awaitable[T]) -> T:
        try:
            return await step
        except Exception as exc:  # noqa: BLE001 - classified in undo()
            raise StepFailed(True, exc) from exc

    async def on_dest(self, step: Awaitable[T]) -> T:
        try:
            return await step
        except Exception as exc:  # noqa: BLE001 - classified in undo()
            raise StepFailed(False, exc) from exc

    async def stop_source(self, step: Awaitable[T]) -> T:
        """Runs the step that stops the request on the source; from here on an undo restarts it."""
        self._stopped_at_s = time.perf_counter()
        return await self.on_source(step)

    def copied(self, payload: KVPayload) -> None:
        self.num_blocks_copied += payload.num_blocks
        self.num_bytes_copied += payload.num_bytes

    def running_on_dest(self, final: RequestSnapshot, num_tokens_with_kv: int) -> None:
        """The destination has the request running: the stop is over."""
        self._final = final
        # Beyond the last token, whose KV every decode step computes anyway.
        self._num_tokens_after_stop = max(0, final.num_tokens - 1 - num_tokens_with_kv)
        if self._stopped_at_s is not None:
            self._stop_s = time.perf_counter() - self._stopped_at_s

    async def hand_over(self) -> MigrationOutcome:
        """The last step: the source releases the request (its stream ends with "migrated")."""
        try:
            await self.source.release_request(self.request_id, self.dest.instance_id)
        except UnknownRequestError as exc:
            # Aborted on the source while stopped (its client left): nobody will read the copy.
            await self._quietly(self.dest.cancel_import(self.request_id))
            return self._outcome(MigrationStatus.FINISHED, f"ended on the source during the hand-off: {exc}")
        except MigrationRefusedError as exc:
            # Its freeze ran out (this driver stalled past lease_s): it runs on the source again,
            # whose stream the client still reads; the copy on the destination must go.
            await self._quietly(self.dest.cancel_import(self.request_id))
            return self._outcome(MigrationStatus.FAILED,
                                 f"the source resumed the request before the hand-off (its {self.lease_s:g} s freeze "
                                 f"lease ran out); it carries on there: {exc}")
        except Exception as exc:  # noqa: BLE001 - the destination has it; the source's stream broke
            logger.warning("migration of %s: source %s failed to release it: %r",
                           self.request_id, self.source.instance_id, exc)
            return self._outcome(MigrationStatus.MIGRATED, f"source failed to release it: {exc!r}")
        return self._outcome(MigrationStatus.MIGRATED, None)

    async def undo(self, failure: StepFailed) -> MigrationOutcome:
        """Leaves the request whole on the source and nothing of it on the destination."""
        await self._quietly(self.dest.cancel_import(self.request_id))
        problems = [str(failure)]
        if self._stopped_at_s is not None:
            try:
                await self.source.unfreeze_request(self.request_id)
            except UnknownRequestError:
                pass  # aborted on the source meanwhile: nothing to resume
            except Exception as exc:  # noqa: BLE001 - reported, nothing more can be done from here
                problems.append(f"and the source could not resume it: {exc!r}")
        cause = failure.cause
        if failure.on_source and isinstance(cause, UnknownRequestError):
            status = MigrationStatus.FINISHED
        elif isinstance(cause, MigrationRefusedError):  # either side declined; nothing broke
            status = MigrationStatus.REFUSED
        else:
            status = MigrationStatus.FAILED
        return self._outcome(status, "; ".join(problems))

    async def drive(self, steps: Callable[[], Awaitable[None]]) -> MigrationOutcome:
        """Runs a protocol's `steps` (up to the destination running the request), then the hand-off;
        any failed step, or the driver's cancellation, is undone instead. The one place every
        protocol's abort safety goes through. The leases on both instances are renewed meanwhile."""
        renewing = asyncio.create_task(self._renew_leases())
        try:
            try:
                await steps()
            except StepFailed as failure:
                return await self.undo(failure)
            except asyncio.CancelledError:
                await self.undo_cancelled()
                raise
            return await self.hand_over()
        finally:
            renewing.cancel()

    async def _renew_leases(self) -> None:
        """Every ``lease_s / 3``: tells both instances this driver is alive. One after the other, so
        an instance that hangs stops the renewals of both (and its peer undoes its side in time)."""
        while True:
            await asyncio.sleep(self.lease_s / 3)  # the renewal period, not a synchronisation
            for endpoint in (self.source, self.dest):
                try:
                    await endpoint.renew_lease(self.request_id, self.lease_s)
                except Exception as exc:  # noqa: BLE001 - the next step meets the same failure
                    logger.info("migration of %s: renewing its lease on %s: %r", self.request_id,
                                endpoint.instance_id, exc)

    async def undo_cancelled(self) -> None:
        """The driver was cancelled mid-way: undo, then let the cancellation go on."""
        await asyncio.shield(self.undo(StepFailed(False, asyncio.CancelledError())))

    async def _quietly(self, step: Awaitable[None]) -> None:
        try:
            await step
        except Exception as exc:  # noqa: BLE001 - a dead destination has nothing left to free
            logger.info("migration of %s: cleanup on %s: %r", self.request_id, self.dest.instance_id, exc)

    def _outcome(self, status: MigrationStatus, error: str | None) -> MigrationOutcome:
        outcome = MigrationOutcome(
            request_id=self.request_id,
            method=self.method,
            status=status,
            source_id=self.source.instance_id,
            destination_id=self.dest.instance_id,
            num_rounds=self.num_rounds,
            num_tokens_at_stop=self._final.num_tokens if self._final is not None else 0,
            num_tokens_after_stop=self._num_tokens_after_stop,
            num_blocks_copied=self.num_blocks_copied,
            num_bytes_copied=self.num_bytes_copied,
            stop_s=self._stop_s,
            total_s=time.perf_counter() - self._started_s,
            error=error,
        )
        logger.info("migration %s", outcome)
        return outcome
