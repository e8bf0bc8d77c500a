"""What a deployed model is: `ModelSpec`, its `ResourceSpec` and its `AutoscalingPolicy`.

A spec is what a user deploys (`thaw deploy -f spec.yaml`, or flags) and what the state store
keeps. Everything is validated once, here, so the registry, the autoscaler and the placement
policy can trust the values. A bad spec raises `SpecError`, which names the field by its
dotted path and says why (``autoscaling.max_instances: must be >= min_instances (2), got 1``);
unknown fields are refused by name, so a typo never silently falls back to a default.

Names are tenant-scoped (``acme/llama-8b``) and restricted to lowercase letters, digits and
``- _ .`` with no ``..``, starting and ending with a letter or digit: they become Redis keys, directory names
in the SSD cache and URL path segments, so nothing in them may climb out of a directory or
look like a flag.

The autoscaling keys follow Ray Serve's names where they mean the same thing
(``target_ongoing_requests``, ``upscale_delay_s``, ``downscale_delay_s``); ``keep_alive_s`` is
ServerlessLLM's idle time before scaling to zero.

The dataclasses do no I/O; the reading of spec files and the parsing of command-line flags
are the module functions at the end (`load_model_spec`, `add_model_spec_arguments`,
`model_spec_from_arguments`), which turn their input into plain data for `from_dict`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from wire import TOOL_CALL_FORMATS

DTYPES = ("auto", "float32", "float16", "bfloat16")
TOOL_CALL_PARSERS = ("auto", "none", *TOOL_CALL_FORMATS)
MAX_NAME_LENGTH = 63
MAX_PRIORITY = 100
# Starts and ends with a letter or digit (no hidden files, nothing that reads as a flag, no
# trailing dot that some filesystems drop), with only characters that are safe in a file
# name, a Redis key and a URL path segment alike in between.
_NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9._-]*[a-z0-9])?")
# S3 bucket naming rules: 3-63 characters, lowercase letters, digits, dots and hyphens,
# starting and ending with a letter or digit.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class SpecError(ValueError):
    """An invalid model spec: `field` is the dotted path of the culprit, `reason` says why."""

    def __init__(self, field_path: str, reason: str) -> None:
        super().__init__(f"{field_path}: {reason}")
        self.field = field_path
        self.reason = reason

    def within(self, parent: str) -> SpecError:
        """The same error seen from the enclosing object (``max_instances`` -> ``autoscaling.max_instances``)."""
        return SpecError(f"{parent}.{self.field}", self.reason)


def validate_name(field_path: str, value: object) -> str:
    """Check one tenant or model name; return it, or raise `SpecError` naming `field_path`."""
    if not isinstance(value, str):
        raise SpecError(field_path, f"must be a string, got {type(value).__name__}")
    if not value:
        raise SpecError(field_path, "must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise SpecError(field_path, f"must be at most {MAX_NAME_LENGTH} characters, got {len(value)}")
    if "/" in value or "\\" in value:
        raise SpecError(field_path, f"must not contain '/' or '\\', got {value!r}")
    if ".." in value:
        raise SpecError(field_path, f"must not contain '..', got {value!r}")
    if not _NAME_RE.fullmatch(value):
        raise SpecError(
            field_path,
            "must be lowercase letters, digits, '-', '_' or '.', starting and ending with a letter or digit, "
            f"got {value!r}",
        )
    return value


def parse_model_id(model_id: object) -> tuple[str, str]:
    """Split ``tenant/name`` into its validated parts (the form the API and the CLI use)."""
    if not isinstance(model_id, str) or model_id.count("/") != 1:
        raise SpecError("name", f"must be 'tenant/model', got {model_id!r}")
    tenant, name = model_id.split("/")
    return validate_name("tenant", tenant), validate_name("name", name)


def _is_int(value: object) -> bool:
    # bool is an int in Python; `min_instances: true` in YAML is a mistake, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(field_path: str, value: object, *, minimum: int) -> int:
    if not _is_int(value):
        raise SpecError(field_path, f"must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(field_path, f"must be >= {minimum}, got {value}")
    return int(value)


def _float(field_path: str, value: object, *, minimum: float, exclusive: bool = False) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise SpecError(field_path, f"must be a finite number, got {value!r}")
    if value < minimum or (exclusive and value == minimum):
        raise SpecError(field_path, f"must be {'>' if exclusive else '>='} {minimum:g}, got {value:g}")
    return float(value)


S3_SOURCE_PREFIX = "s3://"  # a source in a bucket (the repository's, or another read for the deploy)


def _check_source(value: object) -> str:
    """A checkpoint location: an absolute local path, ``s3://bucket[/prefix]``, or ``upload:<id>``
    (a directory uploaded through the admin API, `controller.upload_area`)."""
    if not isinstance(value, str) or not value.strip():
        raise SpecError("source", f"must be a local path or s3://bucket/prefix, got {value!r}")
    if "\x00" in value:
        raise SpecError("source", "must not contain a NUL character")
    if value.startswith("upload:"):
        upload_id = value[len("upload:"):]
        if len(upload_id) != 32 or any(c not in "0123456789abcdef" for c in upload_id):
            raise SpecError("source", f"an upload source is upload:<32 hex digits>, got {value!r}")
        return value
    if "://" in value:
        scheme, rest = value.split("://", 1)
        if scheme != "s3":
            raise SpecError("source", f"unsupported scheme '{scheme}://'; use a local path or s3://bucket/prefix")
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise SpecError("source", f"invalid S3 bucket name {bucket!r} in {value!r}")
        if any(part in (".", "..") for part in prefix.split("/")):
            raise SpecError("source", f"S3 prefix must not contain '.' or '..' segments, got {value!r}")
        return value
    if not os.path.isabs(value):
        # The controller resolves paths on its own machine, from its own working directory:
        # a relative path would silently mean something else there.
        raise SpecError("source", f"a local path must be absolute, got {value!r}")
    return os.path.normpath(value)


def _reject_unknown(data: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    if not isinstance(data, Mapping):
        raise SpecError(where or "spec", f"must be a mapping, got {type(data).__name__}")
    for key in data:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            suggestion = f"; did you mean '{hint[0]}'?" if hint else f"; known fields: {', '.join(known)}"
            raise SpecError(f"{where}.{key}" if where else str(key), f"unknown field{suggestion}")


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True, kw_only=True)
class ResourceSpec:
    """What one instance of the model occupies.

    Fields:
        num_cpus: Ray CPU resources reserved per instance (fractions allowed).
        num_gpus: Ray GPU resources per instance; 0 on CPU-only nodes.
        num_worker_slots: node worker slots per instance. On a CUDA node a slot is a GPU; on a
            CPU-only node it is a configured share of the CPU.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    num_worker_slots: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_cpus", _float("num_cpus", self.num_cpus, minimum=0.0, exclusive=True))
        object.__setattr__(self, "num_gpus", _float("num_gpus", self.num_gpus, minimum=0.0))
        object.__setattr__(self, "num_worker_slots", _int("num_worker_slots", self.num_worker_slots, minimum=1))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResourceSpec:
        _reject_unknown(data, _field_names(cls), "")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class AutoscalingPolicy:
    """How many instances a model should have, and how fast that number may move.

    Fields:
        min_instances: floor; 0 lets the model scale to zero when idle.
        max_instances: ceiling, >= 1 and >= min_instances.
        target_ongoing_requests: in-flight requests one instance should carry; the desired
            count is ceil(demand / target).
        upscale_delay_s: how long a wish for more instances must persist before acting. Short,
            because a cold start is what users wait for; non-zero, to ignore one-tick spikes.
        downscale_delay_s: how long a wish for fewer instances must persist; long, because
            scaling down and back up costs a cold start.
        keep_alive_s: idle time (no ongoing or queued request) before scaling to zero, when
            `keep_alive_per_restart` is None.
        keep_alive_per_restart: None (a fixed `keep_alive_s`), or: the keep-alive is this many
            times the model's estimated restart time (its checkpoint's read from the node's
            fastest tier), within [`min_keep_alive_s`, `max_keep_alive_s`]. Why: a model that
            restarts in 0.2 s loses little by being stopped, one that takes 9 s misses a TTFT
            objective on every cold start; a fixed keep-alive holds both alike. Measured in the
            simulator (BENCHMARKS.md, "Cluster-scale simulation"; 10,000 models, a day): 30,
            with upscale_delay_s 0 and downscale_delay_s 600, used 37% fewer accelerator-seconds
            than a fixed 60 s keep-alive at a higher SLO attainment (with this policy's 1 s / 30 s
            delays the attainment was lower).
        min_keep_alive_s / max_keep_alive_s: the bounds of that keep-alive.
        max_queued_requests: requests the gateway holds for this model while no instance is
            ready; beyond it new requests get 429. At least 1, or a cold model could never
            serve its first request.
        queue_timeout_s: how long a queued request waits for an instance before a 503.
        priority: when slots are contended, higher wins: the waiting models are served oldest
            request first with `priority` weighing in (`controller.slot_queue_policy`), and a
            busy instance is preempted only for a model of equal or higher priority, lowest
            priority first. An integer in [-100, 100]; 0 by default.
        max_wait_before_preempt_s: how long this model's oldest request may wait for a slot
            while every slot is busy before the controller preempts a busy instance of a model
            of no higher priority for it (`controller.preemption_policy`); with `ttft_slo_s`
            only for a model of lower priority: one of equal priority is preempted only when that
            saves a request's deadline.
        ttft_slo_s: each request's deadline for its first token, in seconds from its arrival
            (issue 39): a waiting model preempts a busy instance of equal priority only when its
            newest queued request can still get its first token within it once the model has
            loaded (a preemption that saves no deadline only moves the misses).
    """

    min_instances: int = 0
    max_instances: int = 1
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 30.0
    keep_alive_s: float = 60.0
    keep_alive_per_restart: float | None = None
    min_keep_alive_s: float = 10.0
    max_keep_alive_s: float = 180.0
    max_queued_requests: int = 100
    queue_timeout_s: float = 60.0
    priority: int = 0
    max_wait_before_preempt_s: float = 5.0
    ttft_slo_s: float = 5.0

    def __post_init__(self) -> None:
        min_instances = _int("min_instances", self.min_instances, minimum=0)
        max_instances = _int("max_instances", self.max_instances, minimum=1)
        if max_instances < min_instances:
            raise SpecError("max_instances", f"must be >= min_instances ({min_instances}), got {max_instances}")
        object.__setattr__(self, "min_instances", min_instances)
        object.__setattr__(self, "max_instances", max_instances)
        object.__setattr__(
            self,
            "target_ongoing_requests",
            _float("target_ongoing_requests", self.target_ongoing_requests, minimum=0.0, exclusive=True),
        )
        for name in ("upscale_delay_s", "downscale_delay_s", "keep_alive_s", "min_keep_alive_s", "max_keep_alive_s"):
            object.__setattr__(self, name, _float(name, getattr(self, name), minimum=0.0))
        if self.keep_alive_per_restart is not None:
            object.__setattr__(self, "keep_alive_per_restart",
                               _float("keep_alive_per_restart", self.keep_alive_per_restart, minimum=0.0,
                                      exclusive=True))
        if self.max_keep_alive_s < self.min_keep_alive_s:
            raise SpecError("max_keep_alive_s", f"must be >= min_keep_alive_s ({self.min_keep_alive_s:g}), "
                                                f"got {self.max_keep_alive_s:g}")
        object.__setattr__(
            self, "max_queued_requests", _int("max_queued_requests", self.max_queued_requests, minimum=1)
        )
        object.__setattr__(
            self, "queue_timeout_s", _float("queue_timeout_s", self.queue_timeout_s, minimum=0.0, exclusive=True)
        )
        priority = _int("priority", self.priority, minimum=-MAX_PRIORITY)
        if priority > MAX_PRIORITY:
            raise SpecError("priority", f"must be <= {MAX_PRIORITY}, got {priority}")
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "max_wait_before_preempt_s",
                           _float("max_wait_before_preempt_s", self.max_wait_before_preempt_s, minimum=0.0))
        object.__setattr__(self, "ttft_slo_s", _float("ttft_slo_s", self.ttft_slo_s, minimum=0.0, exclusive=True))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutoscalingPolicy:
        _reject_unknown(data, _field_names(cls), "")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One deployable model of one tenant.

    Fields:
        tenant: owner; part of the model id.
        name: the model's name within the tenant; ``model_id`` is ``tenant/name``.
        source: where the checkpoint lives: an absolute local path, ``s3://bucket/prefix``, or
            ``upload:<id>`` (a directory uploaded through the admin API; ``thaw deploy`` does it).
        dtype: weights dtype; "auto" keeps the checkpoint's.
        max_model_len: longest prompt + output; None means the model's own limit. A deploy refuses
            one the instance's KV pool cannot hold, with the numbers.
        kv_cache_bytes: an instance's KV-cache pool in bytes; None means the platform's default
            (512 MiB: about 4,000 tokens of an 8B model in bf16).
        max_num_seqs: requests one instance runs in its batch at once; None means the platform's
            default (64).
        tool_call_parser: how the gateway reads tool calls out of the model's chat output (vLLM's
            names): "auto" (the default) picks the format the chat template teaches when the model
            is deployed, "none" leaves calls as text, or one of `wire.TOOL_CALL_FORMATS`.
        resources: what one instance occupies.
        autoscaling: how the instance count follows load.
    """

    tenant: str
    name: str
    source: str
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int | None = None
    tool_call_parser: str = "auto"
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    autoscaling: AutoscalingPolicy = field(default_factory=AutoscalingPolicy)

    def __post_init__(self) -> None:
        validate_name("tenant", self.tenant)
        validate_name("name", self.name)
        object.__setattr__(self, "source", _check_source(self.source))
        if self.dtype not in DTYPES:
            raise SpecError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name, minimum in (("max_model_len", 1), ("kv_cache_bytes", 1 << 20), ("max_num_seqs", 1)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _int(name, getattr(self, name), minimum=minimum))
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise SpecError("tool_call_parser", f"must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                                                f"got {self.tool_call_parser!r}")
        if not isinstance(self.resources, ResourceSpec):
            raise SpecError("resources", f"must be a ResourceSpec, got {type(self.resources).__name__}")
        if not isinstance(self.autoscaling, AutoscalingPolicy):
            raise SpecError("autoscaling", f"must be an AutoscalingPolicy, got {type(self.autoscaling).__name__}")

    @property
    def model_id(self) -> str:
        """``tenant/name``: the id clients put in ``"model"`` and the key everything is stored under."""
        return f"{self.tenant}/{self.name}"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Build a spec from plain data (parsed YAML/JSON, an API body).

        ``name`` may be ``tenant/model`` when ``tenant`` is absent. Nested sections may be
        partial: missing keys take their defaults.
        """
        _reject_unknown(data, _field_names(cls), "")
        values = dict(data)
        for required in ("name", "source"):
            if required not in values:
                raise SpecError(required, "required")
        if "tenant" not in values:
            if not isinstance(values["name"], str) or "/" not in values["name"]:
                raise SpecError("tenant", "required (or give name as 'tenant/model')")
            values["tenant"], values["name"] = parse_model_id(values["name"])
        for section, section_cls in (("resources", ResourceSpec), ("autoscaling", AutoscalingPolicy)):
            if section in values and not isinstance(values[section], section_cls):
                raw = values[section] if values[section] is not None else {}
                if not isinstance(raw, Mapping):
                    raise SpecError(section, f"must be a mapping, got {type(raw).__name__}")
                try:
                    values[section] = section_cls.from_dict(raw)
                except SpecError as exc:
                    raise exc.within(section) from None
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `from_dict` turns back into an equal spec (JSON- and YAML-safe)."""
        return {
            "tenant": self.tenant,
            "name": self.name,
            "source": self.source,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "kv_cache_bytes": self.kv_cache_bytes,
            "max_num_seqs": self.max_num_seqs,
            "tool_call_parser": self.tool_call_parser,
            "resources": self.resources.to_dict(),
            "autoscaling": self.autoscaling.to_dict(),
        }


# --- spec files -------------------------------------------------------------------------------


def _read_spec_file(path: str | os.PathLike[str]) -> Any:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise SpecError(str(path), "a spec file must end in .yaml, .yml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(str(path), f"cannot read: {exc.strerror or exc}") from None
    try:
        return json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError(str(path), f"not valid {'JSON' if suffix == '.json' else 'YAML'}: {exc}") from None


def _resolve_source(data: Any, base_dir: Path) -> Any:
    """A relative local ``source`` is relative to `base_dir` (the spec file's folder, or the
    shell's directory for flags), resolved here, on the user's side, before it travels."""
    if isinstance(data, Mapping) and isinstance(data.get("source"), str):
        source = data["source"]
        if source and "://" not in source and not os.path.isabs(source):
            data = {**data, "source": str(base_dir / source)}
    return data


def load_model_specs(path: str | os.PathLike[str]) -> list[ModelSpec]:
    """Read one spec (a mapping) or several (a list, or ``{"models": [...]}``) from YAML/JSON.

    Errors name the file and, for a list, the entry: ``models[1].autoscaling.max_instances: ...``.
    """
    data = _read_spec_file(path)
    base_dir = Path(path).resolve().parent
    if isinstance(data, Mapping) and set(data) == {"models"}:
        data = data["models"]
    entries = data if isinstance(data, list) else [data]
    specs = []
    for index, entry in enumerate(entries):
        try:
            if not isinstance(entry, Mapping):
                raise SpecError("spec", f"must be a mapping, got {type(entry).__name__}")
            specs.append(ModelSpec.from_dict(_resolve_source(entry, base_dir)))
        except SpecError as exc:
            error = exc.within(f"models[{index}]") if isinstance(data, list) else exc
            raise SpecError(f"{path}: {error.field}", error.reason) from None
    if not specs:
        raise SpecError(str(path), "no model spec in the file")
    return specs


def load_model_spec(path: str | os.PathLike[str]) -> ModelSpec:
    """Read exactly one spec from a YAML/JSON file."""
    specs = load_model_specs(path)
    if len(specs) != 1:
        raise SpecError(str(path), f"expected one model spec, found {len(specs)}")
    return specs[0]


# --- flags ------------------------------------------------------------------------------------

# flag -> (dotted field path, argparse type, help). Nested fields keep their plain names as
# flags (``--max-instances``): they are unique across sections and are what users type.
_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--name", "name", str, "model id 'tenant/model' (or the model name with --tenant)"),
    ("--tenant", "tenant", str, "tenant that owns the model"),
    ("--source", "source", str, "checkpoint location: a local path or s3://bucket/prefix"),
    ("--dtype", "dtype", str, f"weights dtype: {', '.join(DTYPES)}"),
    ("--max-model-len", "max_model_len", int, "longest prompt + output in tokens"),
    ("--kv-cache-bytes", "kv_cache_bytes", int, "KV-cache pool per instance, bytes (default 512 MiB)"),
    ("--max-num-seqs", "max_num_seqs", int, "requests batched at once per instance (default 64)"),
    ("--tool-call-parser", "tool_call_parser", str,
     f"how tool calls are read from chat output: {', '.join(TOOL_CALL_PARSERS)} (default auto: from the chat template)"),
    ("--num-cpus", "resources.num_cpus", float, "CPUs per instance"),
    ("--num-gpus", "resources.num_gpus", float, "GPUs per instance"),
    ("--num-worker-slots", "resources.num_worker_slots", int, "worker slots per instance"),
    ("--min-instances", "autoscaling.min_instances", int, "fewest instances (0 = scale to zero)"),
    ("--max-instances", "autoscaling.max_instances", int, "most instances"),
    ("--target-ongoing-requests", "autoscaling.target_ongoing_requests", float, "in-flight requests per instance"),
    ("--upscale-delay-s", "autoscaling.upscale_delay_s", float, "seconds a scale-up wish must last"),
    ("--downscale-delay-s", "autoscaling.downscale_delay_s", float, "seconds a scale-down wish must last"),
    ("--keep-alive-s", "autoscaling.keep_alive_s", float, "idle seconds before scaling to zero"),
    ("--keep-alive-per-restart", "autoscaling.keep_alive_per_restart", float,
     "keep-alive as a multiple of the model's restart time (instead of --keep-alive-s)"),
    ("--min-keep-alive-s", "autoscaling.min_keep_alive_s", float, "shortest keep-alive with --keep-alive-per-restart"),
    ("--max-keep-alive-s", "autoscaling.max_keep_alive_s", float, "longest keep-alive with --keep-alive-per-restart"),
    ("--max-queued-requests", "autoscaling.max_queued_requests", int, "requests held while no instance is ready"),
    ("--queue-timeout-s", "autoscaling.queue_timeout_s", float, "seconds a queued request may wait"),
    ("--priority", "autoscaling.priority", int, "higher wins when slots are contended (-100..100)"),
    ("--max-wait-before-preempt-s", "autoscaling.max_wait_before_preempt_s", float,
     "seconds a request waits for a busy slot before a lower-priority model is preempted"),
    ("--ttft-slo-s", "autoscaling.ttft_slo_s", float,
     "seconds to a request's first token it should meet (equal priorities preempt only to save one)"),
)


def _dest(dotted: str) -> str:
    return "spec__" + dotted.replace(".", "__")


def _metavar(flag: str, kind: type) -> str:
    """What ``--help`` shows for a flag's value: SECONDS, BYTES, N or X by its unit and type, else
    the flag's last word (``--source SOURCE``), never the internal dest (``SPEC__AUTOSCALING__...``)."""
    if flag.endswith("-s"):
        return "SECONDS"
    if flag.endswith("-bytes"):
        return "BYTES"
    if kind is int:
        return "N"
    if kind is float:
        return "X"
    return flag.rsplit("-", 1)[-1].upper()


def add_model_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per spec field. Flags left out are absent from the namespace, so they
    neither override a spec file nor hide the dataclass defaults."""
    group = parser.add_argument_group("model spec")
    for flag, dotted, kind, help_text in _FLAGS:
        group.add_argument(flag, dest=_dest(dotted), type=kind, default=argparse.SUPPRESS, help=help_text,
                           metavar=_metavar(flag, kind))


def model_spec_from_arguments(
    args: argparse.Namespace,
    base: ModelSpec | Mapping[str, Any] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> ModelSpec:
    """Build a spec from parsed flags, on top of `base` (e.g. a spec file) when given.

    A relative ``--source`` is taken relative to `cwd` (default: the current directory).
    Errors name the flag: ``--max-instances: must be >= min_instances (2), got 1``.
    """
    data: dict[str, Any] = dict(base.to_dict() if isinstance(base, ModelSpec) else (base or {}))
    for section in ("resources", "autoscaling"):
        data[section] = dict(data.get(section) or {})
    given = vars(args)
    for _, dotted, _, _ in _FLAGS:
        if _dest(dotted) not in given:
            continue
        section, _, key = dotted.rpartition(".")
        (data[section] if section else data)[key] = given[_dest(dotted)]
    if "tenant" in data and isinstance(data.get("name"), str) and "/" in data["name"]:
        # --name tenant/model overrides a base spec's separate tenant field.
        if _dest("tenant") not in given:
            del data["tenant"]
    data = _resolve_source(data, Path(cwd) if cwd is not None else Path.cwd())
    try:
        return ModelSpec.from_dict(data)
    except SpecError as exc:
        flag = next((f for f, dotted, _, _ in _FLAGS if dotted == exc.field), None)
        if flag is None:
            raise
        raise SpecError(flag, exc.reason) from None
