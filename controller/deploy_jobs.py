"""Deploys as jobs: `DeployJobs` runs each deploy or update in the background and says where it is.

A deploy converts and uploads a checkpoint: seconds for the demo model, minutes for an 8B one
(0.3 GB/s measured on the CI machine). No caller should block on it -- the gateway's controller
calls time out after 30 s, and a user wants to see progress -- so `start` checks what can be
checked at once (the spec, a conflicting deploy: the caller's 400 or 409 comes straight back),
then answers with the job's first `wire.DeployProgress` while the work runs as a task on the
controller's loop. The work's own thread reports stage and bytes through `DeployJob.report`
(the push's progress callback), the job computes rate and ETA from them, and `get` / `recent`
hand out snapshots.

The jobs are the controller's volatile state: a restarted controller knows none (the deploy it
was running left nothing visible -- the repository's push is staged, the spec is saved last --
and can simply be run again). A job's error is what a user can act on: the controller's own
refusals and the repository's errors as their messages, anything else as "an internal error"
with the details in the controller's log, never a traceback.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from controller.controller_errors import ControllerError, DeployConflictError, UnknownDeployError
from storage import RepositoryError
from wire import DeployProgress, DeployStage, DeployState

logger = logging.getLogger(__name__)

__all__ = ["DeployJob", "DeployJobs", "deploy_error_message"]

DEFAULT_KEPT_JOBS = 64  # finished jobs remembered (running ones always are)


def deploy_error_message(exc: BaseException) -> tuple[str, str | None, str]:
    """(message, field, kind) a user sees for a failed deploy (kind: `wire.DeployProgress.error_kind`):
    the controller's refusals and the repository's errors as they are worded, an OS error by its
    reason; anything else is an internal error whose details stay in the log."""
    if isinstance(exc, DeployConflictError):
        return str(exc), None, "conflict"
    if isinstance(exc, LookupError) and isinstance(exc, ControllerError):
        return str(exc).strip("'\""), None, "not_found"
    if isinstance(exc, ControllerError):
        return str(exc), getattr(exc, "field", None), "invalid"
    if isinstance(exc, RepositoryError):
        return f"the model repository failed: {exc}", None, "failed"
    if isinstance(exc, OSError) and exc.strerror:
        return f"reading or writing the checkpoint failed: {exc.strerror}", None, "failed"
    return (f"an internal error ({type(exc).__name__}) stopped the deploy; the controller's log has the details",
            None, "failed")


class DeployJob:
    """One deploy's progress. `report` is called from the worker thread that converts and uploads;
    everything else on the controller's loop. A lock keeps a snapshot from mixing two reports."""

    def __init__(self, deploy_id: str, model_id: str, action: str, *, wall_clock: Callable[[], float],
                 clock: Callable[[], float]) -> None:
        self.deploy_id = deploy_id
        self.model_id = model_id
        self.action = action
        self._wall_clock = wall_clock
        self._clock = clock
        self._lock = threading.Lock()
        self._state = DeployState.PENDING
        self._stage = DeployStage.CHECKING
        self._done = 0
        self._total = 0
        self._stage_started = clock()
        self._started_s = wall_clock()
        self._finished_s: float | None = None
        self._error: tuple[str, str | None, str] | None = None
        self._spec: dict[str, Any] | None = None
        self.task: asyncio.Task | None = None

    def report(self, stage: DeployStage, num_bytes_done: int = 0, num_bytes_total: int = 0) -> None:
        """The work is at `stage`, `num_bytes_done` of `num_bytes_total` (thread-safe). A new stage
        restarts the rate's clock."""
        with self._lock:
            if self._state is DeployState.PENDING:
                self._state = DeployState.RUNNING
            if stage is not self._stage:
                self._stage, self._stage_started = stage, self._clock()
            self._done, self._total = max(0, int(num_bytes_done)), max(0, int(num_bytes_total))

    def succeed(self, spec: dict[str, Any]) -> None:
        with self._lock:
            self._state, self._stage, self._spec = DeployState.SUCCEEDED, DeployStage.DONE, spec
            self._finished_s = self._wall_clock()

    def fail(self, message: str, field: str | None = None, kind: str = "failed") -> None:
        with self._lock:
            self._state, self._error = DeployState.FAILED, (message, field, kind)
            self._finished_s = self._wall_clock()

    @property
    def finished(self) -> bool:
        return self._finished_s is not None

    def record(self) -> DeployProgress:
        """A snapshot, with the current stage's mean rate and the ETA at that rate."""
        with self._lock:
            rate = eta = None
            elapsed = self._clock() - self._stage_started
            if not self.finished and self._done > 0 and elapsed > 0:
                rate = self._done / elapsed
                eta = max(0, self._total - self._done) / rate if self._total else None
            error, field, kind = self._error if self._error is not None else (None, None, None)
            return DeployProgress(
                deploy_id=self.deploy_id, model_id=self.model_id, action=self.action, state=self._state,
                stage=self._stage, num_bytes_done=self._done, num_bytes_total=self._total, bytes_per_s=rate,
                eta_s=eta, started_s=self._started_s, finished_s=self._finished_s, error=error, error_field=field,
                error_kind=kind, spec=self._spec)


class DeployJobs:
    """The controller's deploy jobs (see the module docstring). `keep`: finished jobs remembered."""

    def __init__(self, *, wall_clock: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic,
                 keep: int = DEFAULT_KEPT_JOBS) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self._wall_clock = wall_clock
        self._clock = clock
        self._keep = keep
        self._jobs: OrderedDict[str, DeployJob] = OrderedDict()
        self._ids = itertools.count(1)
        self._prefix = f"d{os.getpid():x}{int(wall_clock()):x}"  # ids of two controller lives never collide

    def start(self, model_id: str, action: str, work: Callable[[DeployJob], Awaitable[dict[str, Any]]]
              ) -> DeployProgress:
        """Runs ``work(job)`` as a task (it returns the deployed spec's dict); returns the job's first
        record. Call on the controller's loop."""
        job = DeployJob(f"{self._prefix}-{next(self._ids)}", model_id, action, wall_clock=self._wall_clock,
                        clock=self._clock)
        self._jobs[job.deploy_id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job, work), name=f"deploy-{job.deploy_id}")
        self._forget_old()
        return job.record()

    def finished(self, model_id: str, action: str, spec: dict[str, Any]) -> DeployProgress:
        """A job that had nothing to do (the same spec deployed again): succeeded at once."""
        job = DeployJob(f"{self._prefix}-{next(self._ids)}", model_id, action, wall_clock=self._wall_clock,
                        clock=self._clock)
        job.succeed(spec)
        self._jobs[job.deploy_id] = job
        self._forget_old()
        return job.record()

    async def _run(self, job: DeployJob, work: Callable[[DeployJob], Awaitable[dict[str, Any]]]) -> None:
        try:
            spec = await work(job)
        except asyncio.CancelledError:
            job.fail("the controller shut down before the deploy finished; nothing of it is visible: run it again")
            raise
        except Exception as exc:  # noqa: BLE001 - every failure ends the job with a message
            message, field, kind = deploy_error_message(exc)
            if not isinstance(exc, ControllerError):
                logger.warning("deploy %s of %s failed", job.deploy_id, job.model_id, exc_info=exc)
            job.fail(message, field, kind)
        else:
            job.succeed(spec)

    def _forget_old(self) -> None:
        finished = [deploy_id for deploy_id, job in self._jobs.items() if job.finished]
        for deploy_id in finished[: max(0, len(finished) - self._keep)]:
            del self._jobs[deploy_id]

    def get(self, deploy_id: str) -> DeployProgress:
        job = self._jobs.get(deploy_id)
        if job is None:
            raise UnknownDeployError(deploy_id)
        return job.record()

    def recent(self) -> list[DeployProgress]:
        """Every remembered job, oldest first."""
        return [job.record() for job in self._jobs.values()]

    async def wait(self, deploy_id: str, timeout_s: float | None = None) -> DeployProgress:
        """The job's record once it has finished, or after `timeout_s` if that comes first (a long
        poll: a caller showing progress asks again)."""
        job = self._jobs.get(deploy_id)
        if job is None:
            raise UnknownDeployError(deploy_id)
        if job.task is not None and not job.task.done():
            done, _ = await asyncio.wait({job.task}, timeout=timeout_s)  # never cancels the job
            del done
        return job.record()

    async def close(self) -> None:
        """Cancels the running jobs (their pushes leave staged files the repository sweeps)."""
        tasks = [job.task for job in self._jobs.values() if job.task is not None and not job.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
