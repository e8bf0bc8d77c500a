"""Errors the controller's API raises on purpose, each with something a caller can act on.

They cross Ray as pickles: Ray re-raises a remote exception as a subclass of its own type, so a
caller writes ``except UnknownModelError`` around ``await controller.get_model.remote(...)``.
Every one therefore pickles with all its fields (`__reduce__`), which an exception with a
custom ``__init__`` does not do by itself.
"""

from __future__ import annotations


class ControllerError(Exception):
    """Base of the controller's deliberate errors."""


class InvalidSpecError(ControllerError, ValueError):
    """A model spec refused: `field` is the dotted path of the culprit, `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.field, self.reason)


class UnknownModelError(ControllerError, LookupError):
    """No model of that id is deployed."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"model {model_id!r} is not deployed")
        self.model_id = model_id

    def __reduce__(self):
        return type(self), (self.model_id,)


class UnknownTenantError(ControllerError, LookupError):
    """No tenant of that name exists (``thaw tenants create`` makes one; deploying a model too)."""

    def __init__(self, tenant: str) -> None:
        super().__init__(f"tenant {tenant!r} does not exist; create it first (thaw tenants create {tenant})")
        self.tenant = tenant

    def __reduce__(self):
        return type(self), (self.tenant,)


class ModelAlreadyDeployedError(ControllerError, ValueError):
    """`deploy` of a model id that exists with a different spec; `update` changes one."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"model {model_id!r} is already deployed with a different spec; use update to change it")
        self.model_id = model_id

    def __reduce__(self):
        return type(self), (self.model_id,)


class DeployConflictError(ModelAlreadyDeployedError):
    """A deploy or update that lost a race: another deploy or update of the same model (or of
    the same repository model) is pushing right now, or a concurrent push into the repository
    won. Exactly one of racing deploys succeeds; this is the other's answer (HTTP 409)."""

    def __init__(self, model_id: str, reason: str) -> None:
        ControllerError.__init__(self, f"model {model_id!r}: {reason}")
        self.model_id = model_id
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.model_id, self.reason)


class InvalidMigrationError(ControllerError, ValueError):
    """A migration request refused as malformed: `field` names the culprit, `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.field, self.reason)


class UnknownInstanceError(ControllerError, LookupError):
    """No model instance of that id is running."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"no instance {instance_id!r} is running (thaw status lists them)")
        self.instance_id = instance_id

    def __reduce__(self):
        return type(self), (self.instance_id,)


class MigrationConflictError(ControllerError, RuntimeError):
    """A well-formed migration that cannot happen now (no ready destination, a loading source);
    the message says what would make it possible."""


class UnknownDeployError(ControllerError, LookupError):
    """No deploy job of that id: never started, or forgotten (the controller keeps the most recent
    ones, and none across a restart)."""

    def __init__(self, deploy_id: str) -> None:
        super().__init__(f"no deploy {deploy_id!r} (the controller keeps its most recent deploys, and none across "
                         f"a restart: thaw list shows whether the model is deployed)")
        self.deploy_id = deploy_id

    def __reduce__(self):
        return type(self), (self.deploy_id,)


class UnknownUploadError(ControllerError, LookupError):
    """No upload of that id (never created, deployed and deleted, or expired)."""

    def __init__(self, upload_id: str) -> None:
        super().__init__(f"no upload {upload_id!r} (uploads are deleted once deployed, and after a day unused): "
                         f"upload the directory again")
        self.upload_id = upload_id

    def __reduce__(self):
        return type(self), (self.upload_id,)


class InvalidUploadError(ControllerError, ValueError):
    """A bad upload request or an upload that does not match what the caller listed; `field` names
    the part (path, offset, files, source)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.field, self.reason)


class UploadOffsetError(ControllerError, RuntimeError):
    """A piece for another offset than where its file's bytes end (HTTP 409): the message names the
    size to resume from (`size`; None when the upload is sealed)."""

    def __init__(self, upload_id: str, path: str, offset: int, size: int | None, reason: str | None = None) -> None:
        super().__init__(reason or f"{path!r} of upload {upload_id} has {size} bytes; send the piece at offset "
                                   f"{size}, not {offset}")
        self.upload_id, self.path, self.offset, self.size, self.reason = upload_id, path, offset, size, reason

    def __reduce__(self):
        return type(self), (self.upload_id, self.path, self.offset, self.size, self.reason)
