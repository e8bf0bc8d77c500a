"""Where one deploy (or update) of a model stands: the record the controller keeps per deploy job.

A deploy of a real-size checkpoint takes minutes (conversion to the thaw format, the upload into
the repository), far longer than one controller call may block. So the controller runs it as a
job and answers at once with this record; the admin API's ``GET /admin/deploys/{id}``, ``thaw
deploy``'s progress bar and ``thaw status`` read it again as it moves (controller -> gateway ->
CLI). Defined once here (house rule 11).

`DeployState` is the job's lifecycle (pending, running, then succeeded or failed, never back);
`DeployStage` says what a running job is doing, in the order a deploy does it. The figures are
for the current stage: ``num_bytes_done`` of ``num_bytes_total``, at ``bytes_per_s`` (the stage's
mean so far), ``eta_s`` to its end. A failed job carries the error a user can act on (and the
spec field it names, as a 400 would), never an internal traceback.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from wire.wire_record import (WireRecord, check_count, check_member, check_name, check_optional_seconds,
                               check_seconds)

__all__ = ["ERROR_KINDS", "DeployProgress", "DeployStage", "DeployState"]


class DeployState(str, enum.Enum):
    PENDING = "pending"  # accepted, not started yet
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # the model is deployed (visible in listings)
    FAILED = "failed"  # nothing of it is visible; `error` says why


class DeployStage(str, enum.Enum):
    """What a running deploy does now, in order (a stage may be skipped: a thaw checkpoint is not
    converted, unchanged content is not uploaded)."""

    DOWNLOADING = "downloading"  # an s3:// source outside the repository, copied to the controller
    CHECKING = "checking"  # reading the source: config, files, is it already in the repository
    CONVERTING = "converting"  # Hugging Face safetensors -> the thaw format
    UPLOADING = "uploading"  # into the repository (checksummed)
    REGISTERING = "registering"  # the spec saved; the model becomes visible
    DONE = "done"


_FINISHED = (DeployState.SUCCEEDED, DeployState.FAILED)
ERROR_KINDS = ("invalid", "conflict", "not_found", "failed")


@dataclass(frozen=True)
class DeployProgress(WireRecord):
    """Fields:
        deploy_id: the job's id (what ``GET /admin/deploys/{id}`` takes).
        model_id: the model deployed.
        action: "deploy" or "update".
        state / stage: see the enums.
        num_bytes_done / num_bytes_total: the current stage's work (0 / 0: not measured in bytes).
        bytes_per_s: the stage's mean rate so far (None before it has one).
        eta_s: seconds to the stage's end at that rate (None: unknown).
        started_s / finished_s: wall-clock times (finished_s None while it runs).
        error / error_field: why it failed, and the spec field that names (None otherwise).
        error_kind: what kind of failure, for callers that answer in HTTP: "invalid" (the spec or
            its source; a 400), "conflict" (another deploy won; 409), "not_found" (the model went
            away; 404), "failed" (the repository or an internal error; 500).
        spec: the deployed spec's dict form once it succeeded.
    """

    SCHEMA: ClassVar[str] = "deploy_progress/1"

    deploy_id: str
    model_id: str
    action: str
    state: DeployState
    stage: DeployStage
    num_bytes_done: int = 0
    num_bytes_total: int = 0
    bytes_per_s: float | None = None
    eta_s: float | None = None
    started_s: float = 0.0
    finished_s: float | None = None
    error: str | None = None
    error_field: str | None = None
    error_kind: str | None = None
    spec: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "deploy_id", self.deploy_id)
        check_name(name, "model_id", self.model_id)
        if self.action not in ("deploy", "update"):
            raise ValueError(f"{name}.action must be 'deploy' or 'update', got {self.action!r}")
        object.__setattr__(self, "state", check_member(name, "state", DeployState, self.state))
        object.__setattr__(self, "stage", check_member(name, "stage", DeployStage, self.stage))
        for field in ("num_bytes_done", "num_bytes_total"):
            object.__setattr__(self, field, check_count(name, field, getattr(self, field)))
        for field in ("bytes_per_s", "eta_s", "finished_s"):
            object.__setattr__(self, field, check_optional_seconds(name, field, getattr(self, field)))
        object.__setattr__(self, "started_s", check_seconds(name, "started_s", self.started_s))
        check_name(name, "error", self.error, optional=True)
        check_name(name, "error_field", self.error_field, optional=True)
        if (self.finished_s is not None) != (self.state in _FINISHED):
            raise ValueError(f"{name}.finished_s must be set exactly when the deploy has finished "
                             f"(state {self.state.value}, finished_s {self.finished_s!r})")
        if (self.error is not None) != (self.state is DeployState.FAILED):
            raise ValueError(f"{name}.error must be set exactly when the deploy failed (state {self.state.value})")
        if self.error_kind not in (None, *ERROR_KINDS) or (self.error_kind is None) != (self.error is None):
            raise ValueError(f"{name}.error_kind must be one of {', '.join(ERROR_KINDS)} exactly when the deploy "
                             f"failed, got {self.error_kind!r}")
        if self.spec is not None and not isinstance(self.spec, dict):
            raise ValueError(f"{name}.spec must be None or the spec's dict form")

    @property
    def finished(self) -> bool:
        return self.state in _FINISHED

    @property
    def elapsed_s(self) -> float | None:
        """From start to finish (None while it runs: the caller's clock says how long so far)."""
        return None if self.finished_s is None else max(0.0, self.finished_s - self.started_s)
