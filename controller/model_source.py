"""Where a deployed model's checkpoint comes from: the spec's source, made a repository model.

Node stores fill only from the platform's repository, by a single-segment model name, so a
deploy turns the spec's ``source`` into such a name:

- a local directory is pushed under ``tenant--name`` -- once, converted to the thaw format and
  stored as that checkpoint alone: a later deploy or update of the same content finds the
  repository copy made from identical files (same files, sizes and xxh3_64) and reuses it; changed content replaces it (the push hides the old version first, so no reader sees a
  mix);
- a location inside the repository itself (``<repository uri>/<model>``, e.g. pushed earlier
  with ``thaw models push``) is used as it is, under that name;
- any other ``s3://`` location is copied to the controller's machine first (by the registry,
  `storage.S3Source`: stage DOWNLOADING) and then pushed as a local directory is, so the
  repository holds it and node stores fill from there alone;
- a local directory that names files outside itself (a symlink, a safetensors index entry such
  as ``../other``) is refused before anything is read (`loader.model_dir_files`): a deploy never
  pulls in someone else's weights;
- a local directory whose config.json the engine would refuse (an architecture it lacks, a
  quantized checkpoint, a RoPE type it does not implement) is refused before the push, naming
  the field (`check_engine_can_run`);
- the spec's ``tool_call_parser: auto`` is resolved from the model's chat templates
  (`resolve_tool_call_format`), so the gateway knows how the model writes tool calls.

``tenant--name`` is unambiguous within one platform only if no two deployed ids map to the same
string (``a--b/c`` and ``a/b--c`` would); the controller refuses the second such deploy.
All of this is blocking I/O (hashing, uploading): the controller runs it in a thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from controller.controller_errors import InvalidSpecError
from controller.model_spec import ModelSpec, parse_model_id
from loader import model_dir_files
from storage import LocalModelRepository, ModelManifest, ModelNotFoundError, ModelRepository, PushProgress
from wire import DeployStage, detect_tool_call_format

_HASH_BLOCK_BYTES = 8 << 20


@dataclass(frozen=True)
class PublishedModel:
    """A spec's checkpoint as the repository holds it. `pushed`: uploaded by this call;
    `replaced`: that upload replaced different content (nodes' cached copies are stale)."""

    repository_name: str
    num_bytes: int
    pushed: bool
    replaced: bool = False
    tool_call_format: str | None = None  # the spec's tool_call_parser resolved (`resolve_tool_call_format`)


# Where a Hugging Face model dir keeps its chat templates (transformers >= 4.50 writes the files;
# older ones only tokenizer_config.json's "chat_template", a string or a list of named ones).
_TEMPLATE_FILES = ("additional_chat_templates/tool_use.jinja", "chat_template.jinja")
_TOKENIZER_CONFIG = "tokenizer_config.json"


def resolve_tool_call_format(spec: ModelSpec, read_file: Callable[[str], bytes | None]) -> str | None:
    """The tool-call format the gateway parses for this model: the spec's ``tool_call_parser``,
    or for "auto" the one its chat templates teach (`wire.detect_tool_call_format`, the tool-use
    template first); None for "none" or a model whose templates teach none. `read_file(path)`
    gives a file of the model dir (None when absent)."""
    if spec.tool_call_parser != "auto":
        return None if spec.tool_call_parser == "none" else spec.tool_call_parser
    templates = [data.decode("utf-8", "replace") for data in map(read_file, _TEMPLATE_FILES) if data is not None]
    config_bytes = read_file(_TOKENIZER_CONFIG)
    if config_bytes is not None:
        try:
            value = json.loads(config_bytes).get("chat_template")
        except (ValueError, AttributeError):  # the engine reports a broken tokenizer config at load
            value = None
        if isinstance(value, str):
            templates.append(value)
        elif isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            templates += [t for name, t in sorted(named.items(), key=lambda kv: kv[0] != "tool_use")
                          if isinstance(t, str)]
    for template in templates:
        found = detect_tool_call_format(template)
        if found is not None:
            return found
    return None


def _dir_reader(src: Path) -> Callable[[str], bytes | None]:
    def read(path: str) -> bytes | None:
        try:
            return (src / path).read_bytes()
        except OSError:
            return None
    return read


def repository_name(model_id: str) -> str:
    """``tenant/name`` -> ``tenant--name``: one path segment, as node stores and repositories need."""
    tenant, name = parse_model_id(model_id)
    return f"{tenant}--{name}"


def _name_inside_repository(source: str, repository_uri: str) -> str | None:
    """The model name when `source` is ``<repository uri>/<model>``, else None."""
    root = repository_uri.rstrip("/") + "/"
    if not source.startswith(root):
        return None
    rest = source[len(root):].strip("/")
    if not rest or "/" in rest:
        raise InvalidSpecError("source", f"{source!r} is inside the repository {repository_uri} but is not "
                                         f"one model directory (<repository>/<model>)")
    return rest


def repository_name_for(spec: ModelSpec, repository_uri: str) -> str:
    """The repository name a spec's checkpoint has (or will have once published): known from
    the spec alone, so a restarted controller needs no I/O to find it."""
    inside = _name_inside_repository(spec.source, repository_uri)
    return inside if inside is not None else repository_name(spec.model_id)


def _local_files(src_dir: Path) -> dict[str, Path]:
    """Relative '/'-path -> file, as a repository push sees the dir (`loader.model_dir_files`)."""
    return dict(model_dir_files(src_dir))


def _xxh3_64(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def same_content(src_dir: Path, manifest: ModelManifest, progress: PushProgress | None = None) -> bool:
    """True if the repository copy was pushed from exactly the dir's files, sizes and xxh3_64
    (`ModelManifest.source_files`: the converted-from dir's fingerprints, or the files as stored).
    Sizes are compared first, so a changed model is usually told apart without hashing. `progress`
    hears the bytes hashed (stage CHECKING)."""
    files = _local_files(src_dir)
    pushed = manifest.source_files
    if set(files) != {entry.path for entry in pushed}:
        return False
    if any(files[entry.path].stat().st_size != entry.size for entry in pushed):
        return False
    total, done = sum(entry.size for entry in pushed), 0
    for entry in pushed:
        if _xxh3_64(files[entry.path]) != entry.xxh3_64:
            return False
        done += entry.size
        if progress is not None:
            progress(DeployStage.CHECKING, done, total)
    return True


def check_engine_can_run(src: Path, spec: ModelSpec | None = None, engine_config: Any = None) -> None:
    """Refuses, before anything is pushed, a checkpoint the engine would refuse at load: its
    config.json read as the engine reads it (`worker.ModelConfig`: architecture, quantization,
    RoPE type, activation, head layout). Raises `InvalidSpecError` on ``source`` naming the field,
    the value and what is supported, instead of a deploy that succeeds and instances that never load.
    Given the spec and its instances' `worker.EngineConfig`, also refuses (on ``max_model_len``) a
    context the KV pool cannot hold (`worker.max_model_len_problem`)."""
    from worker import ModelConfig, max_model_len_problem  # torch: paid on the controller's first deploy only

    dtype = None if spec is None or spec.dtype == "auto" else spec.dtype
    try:
        model = ModelConfig.from_model_dir(src, dtype=dtype)
    except ValueError as exc:  # UnsupportedModelError is one; a missing key or bad JSON the other
        raise InvalidSpecError("source", f"{src} cannot be served: {exc}") from None
    if spec is not None and engine_config is not None:
        problem = max_model_len_problem(model, engine_config, spec.max_model_len)
        if problem is not None:
            raise InvalidSpecError("max_model_len", problem)


def publish_source(spec: ModelSpec, repository: ModelRepository, engine_config: Any = None,
                   progress: PushProgress | None = None) -> PublishedModel:
    """Make the spec's checkpoint a repository model (see the module docstring). Raises
    `InvalidSpecError` on ``source`` when it cannot be used. `engine_config`: the instances'
    `worker.EngineConfig`, to check the model's context against their KV pool. `progress` hears
    each stage's bytes (checking, converting, uploading) as the work goes, from this thread and
    the push's."""
    if progress is not None:
        progress(DeployStage.CHECKING, 0, 0)
    inside = _name_inside_repository(spec.source, repository.uri)
    if inside is not None:
        try:
            manifest = repository.describe(inside)
        except (ModelNotFoundError, ValueError) as exc:
            raise InvalidSpecError("source", str(exc)) from None
        tool_call_format = resolve_tool_call_format(spec, lambda path: repository.read_small_file(inside, path))
        return PublishedModel(inside, manifest.total_bytes, pushed=False, tool_call_format=tool_call_format)
    if "://" in spec.source:
        raise InvalidSpecError("source", f"{spec.source!r} is not in the platform repository {repository.uri}, "
                                         f"and this call reads no other bucket")
    src = Path(spec.source)
    if not src.is_dir():
        raise InvalidSpecError("source", f"{spec.source!r} is not a directory on the controller's machine")
    try:
        model_dir_files(src)
    except ValueError as exc:  # loader.UnsafeModelDirError: it names files outside itself; a broken index
        raise InvalidSpecError("source", str(exc)) from None
    if (src / "config.json").is_file():
        check_engine_can_run(src, spec, engine_config)
    tool_call_format = resolve_tool_call_format(spec, _dir_reader(src))
    name = repository_name(spec.model_id)
    # A local repository's directory appears with its first push; until then it holds nothing.
    fresh = isinstance(repository, LocalModelRepository) and not repository.root.is_dir()
    existed = not fresh and repository.exists(name)
    if existed:
        manifest = repository.describe(name)
        if same_content(src, manifest, progress):
            return PublishedModel(name, manifest.total_bytes, pushed=False, tool_call_format=tool_call_format)
    try:
        manifest = repository.push(src, name, overwrite=True, progress=progress)
    except ValueError as exc:  # neither a thaw nor a Hugging Face dir
        raise InvalidSpecError("source", str(exc)) from None
    return PublishedModel(name, manifest.total_bytes, pushed=True, replaced=existed, tool_call_format=tool_call_format)
