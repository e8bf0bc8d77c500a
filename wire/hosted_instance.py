"""`HostedInstance`: a model instance that lives in a slot host, addressed as if it were an actor.

A slot host (`worker.SlotHost`, ARCHITECTURE.md "Slot hosts") is one worker process holding
several model instances. Every caller of an instance -- the controller, the gateway, the
migration driver -- calls it through Ray like an actor of its own: ``handle.stats.remote()``,
``handle.generate.options(num_returns="streaming").remote(...)``, ``ray.cancel`` on the stream.
`HostedInstance` keeps exactly that surface and sends each call to the host, naming the instance:
``host.call.remote(instance_id, "stats")`` for a plain method, ``host.stream`` (streaming) for a
generator. So nothing that calls an instance needs to know where it lives; only what starts,
stops and finds instances does (`is_hosted`).

It pickles as (host handle, instance id), so it crosses Ray like a handle. Ray is not imported:
the host handle does the calling.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HostedInstance", "is_hosted", "is_slot_host"]


class HostedInstance:
    """The instance `instance_id` in the slot host `host` (a Ray actor handle)."""

    def __init__(self, host: Any, instance_id: str) -> None:
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"HostedInstance needs a non-empty instance id, got {instance_id!r}")
        self.host = host
        self.instance_id = instance_id

    def __getattr__(self, name: str) -> _HostedMethod:
        if name.startswith("_"):  # pickling and copying probe dunder names: not instance methods
            raise AttributeError(name)
        return _HostedMethod(self.host, self.instance_id, name, streaming=False, options={})

    def __repr__(self) -> str:
        return f"HostedInstance({self.instance_id!r} in {self.host!r})"


class _HostedMethod:
    """``HostedInstance.<name>``: ``.remote(...)`` and ``.options(...)`` as on an actor method."""

    def __init__(self, host: Any, instance_id: str, name: str, *, streaming: bool, options: dict[str, Any]) -> None:
        self._host, self._instance_id, self._name = host, instance_id, name
        self._streaming, self._options = streaming, options

    def options(self, **options: Any) -> _HostedMethod:
        options = {**self._options, **options}
        streaming = options.pop("num_returns", None) == "streaming" or self._streaming
        return _HostedMethod(self._host, self._instance_id, self._name, streaming=streaming, options=options)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._streaming:
            method = self._host.stream.options(num_returns="streaming", **self._options)
        else:
            method = self._host.call.options(**self._options) if self._options else self._host.call
        return method.remote(self._instance_id, self._name, *args, **kwargs)


def is_hosted(handle: Any) -> bool:
    """Whether `handle` addresses an instance in a slot host (not an actor of its own)."""
    return isinstance(handle, HostedInstance)


def is_slot_host(actor: Any) -> bool:
    """Whether a found worker actor is a slot host (it has the host's ``host_instance_ids``
    method); a Ray actor handle answers unknown method names with AttributeError."""
    if isinstance(actor, HostedInstance):
        return False
    try:
        getattr(actor, "host_instance_ids")
    except AttributeError:
        return False
    return True
