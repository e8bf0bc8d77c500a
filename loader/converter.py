"""Converts a Hugging Face safetensors model directory into a thaw checkpoint (see `loader.format`).

Two passes over the safetensors headers and data: the first plans the layout from names, dtypes
and shapes only (layer order, 4096-aligned offsets, partitions of at most ``partition_bytes``);
the second reads one tensor at a time (``safe_open`` maps the file, so peak memory is one tensor
plus the staging buffer, never the model), optionally casts it, and streams it through a
`PartitionWriter` that hashes every ``chunk_bytes`` slice with xxh3_64 as it goes.

Crash safety: everything is written into a hidden sibling ``.{name}.tmp-{pid}``; the index is
written last and fsynced, then the directory is renamed to `out_dir` in one step. An exception
removes the temporary directory; a hard crash leaves only the hidden one behind. Either way no
`out_dir` that looks complete but is not can exist.

The source is read through `loader.model_dir`: an index entry or a symlink that leads outside
`hf_dir` is refused (`UnsafeModelDirError`) before anything is read. The output is the owner's
only (`loader.private_files`: directory 0700, files 0600) -- it is a tenant's weights.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from loader.format import (ALIGNMENT_BYTES, INDEX_FILE, PARTITION_FILE_TEMPLATE, PartitionEntry, TensorEntry,
                           ThawIndex, layer_of_tensor)
from loader.model_dir import SAFETENSORS_INDEX_FILE, contained_path, model_dir_files, shard_paths
from loader.partition_writer import PartitionWriter
from loader.private_files import PRIVATE_DIR_MODE, copy_private, open_private

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_PARTITION_BYTES = 10 * GIB
# Also the loader's read size: it reads exactly one checksum chunk per preadv. Measured on the
# 2-vCPU dev machine kind (~0.9 GB bf16, 31 layer groups, pre-faulted pool, checksums on, GB/s
# for 1/2/4/8 threads):
#   page cache warm: 4 MiB 2.9/5.2/5.0/3.7   16 MiB 2.8/5.0/4.9/4.7   32 MiB 2.6/5.2/5.2/5.2   64 MiB 2.9/5.3/5.3/5.4
#   cold, O_DIRECT (2/4 threads, 7 runs interleaved): 16 MiB 0.78/0.86   32 MiB 1.04/1.10   64 MiB 1.19/1.21
# Warm loads do not care; cold O_DIRECT reads want big requests, so 64 MiB. (Readiness of a layer
# is tracked per chunk, so chunks much larger would delay layer-by-layer start on small models.)
DEFAULT_CHUNK_BYTES = 64 * MIB
CAST_DTYPES = ("float32", "float16", "bfloat16")
SAFETENSORS_FILE = "model.safetensors"
COPIED_SUFFIXES = (".json", ".txt", ".model", ".jinja")  # config, tokenizer, vocab, chat template
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers' named chat templates, <name>.jinja each
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}
_PROGRESS_INTERVAL_S = 0.5

ProgressFn = Callable[[int, int], None]  # (bytes_done, bytes_total)


@dataclass(frozen=True)
class _SourceTensor:
    name: str
    file: Path
    dtype: str  # after the optional cast
    shape: tuple[int, ...]
    layer: int | None  # None: the final group, numbered once the layer count is known
    position: int  # order met in the source files

    @property
    def size(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * getattr(torch, self.dtype).itemsize


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The weight files of a Hugging Face model dir: its index's shards, else model.safetensors
    (each inside `hf_dir`: `UnsafeModelDirError` otherwise)."""
    index_path = hf_dir / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path} is not a valid safetensors index: {exc!r}") from None
        files = shard_paths(hf_dir, weight_map)
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} listed in {index_path} is missing")
        return files
    if (hf_dir / SAFETENSORS_FILE).is_file():
        return [contained_path(hf_dir, SAFETENSORS_FILE, "the weights file")]
    raise FileNotFoundError(f"no weights in {hf_dir}: expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE}")


def _scan(files: list[Path], dtype: str | None) -> list[_SourceTensor]:
    found: dict[str, _SourceTensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in found:
                    raise ValueError(f"tensor {name!r} is in both {found[name].file} and {path}")
                info = f.get_slice(name)
                src_dtype = _SAFETENSORS_DTYPES.get(info.get_dtype())
                if src_dtype is None:
                    raise ValueError(f"{path}: tensor {name!r} has dtype {info.get_dtype()}, "
                                     f"which thaw does not support")
                if dtype is not None and getattr(torch, src_dtype).is_floating_point:
                    src_dtype = dtype
                found[name] = _SourceTensor(name=name, file=path, dtype=src_dtype, shape=tuple(info.get_shape()),
                                            layer=layer_of_tensor(name), position=len(found))
    if not found:
        raise ValueError(f"no tensors in {', '.join(map(str, files))}")
    return list(found.values())


def _round_up(n: int) -> int:
    return -(-n // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


# Projections the engine runs as one matmul (Q/K/V, gate/up). Written back to back, in this order,
# they form one contiguous [sum of rows, hidden] block once loaded, which the engine takes as a
# view instead of concatenating copies (~0.45 s per GB of weights on this machine kind). Their
# sizes are multiples of 4 KiB for every real model, so the alignment adds no gap between them.
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fusion_rank(name: str) -> tuple:
    """Sort key within a layer: fused projections first, grouped and in group order (weights
    and biases apart); every other tensor after them, in source-file order."""
    parts = name.rsplit(".", 2)  # [..., "q_proj", "weight"]
    if len(parts) == 3:
        for group_index, group in enumerate(_FUSED_GROUPS):
            if parts[1] in group:
                return (0, parts[2], group_index, group.index(parts[1]))
    return (1,)


def _plan(sources: list[_SourceTensor],
          partition_bytes: int) -> tuple[int, list[tuple[_SourceTensor, TensorEntry]], int]:
    """Layer order and placement: the layer count, [(source, entry)] in file order, total bytes."""
    num_layers = 1 + max((s.layer for s in sources if s.layer is not None), default=-1)
    num_layers = max(num_layers, 0)

    def layer(s: _SourceTensor) -> int:
        return num_layers if s.layer is None else s.layer

    placed = []
    partition, offset, total_bytes = 0, 0, 0
    for s in sorted(sources, key=lambda s: (layer(s), _fusion_rank(s.name), s.position)):
        # A tensor never spans partitions; one larger than partition_bytes gets a partition of its own.
        if offset > 0 and offset + s.size > partition_bytes:
            partition, offset = partition + 1, 0
        placed.append((s, TensorEntry(name=s.name, dtype=s.dtype, shape=s.shape, partition=partition, offset=offset,
                                      size=s.size, layer=layer(s))))
        offset += _round_up(s.size)
        total_bytes += _round_up(s.size)
    return num_layers, placed, total_bytes


def _copy_extra_files(source_files: list[tuple[str, Path]], out_dir: Path) -> list[str]:
    """Copy the top-level config/tokenizer files (`COPIED_SUFFIXES`) of the checked source listing,
    and the named chat templates transformers saves under `CHAT_TEMPLATE_DIR`."""
    copied = []
    for rel, path in source_files:
        top_level = ("/" not in rel and path.suffix in COPIED_SUFFIXES
                     and not rel.endswith(".safetensors.index.json") and rel != INDEX_FILE)
        named_template = rel.startswith(CHAT_TEMPLATE_DIR + "/") and rel.count("/") == 1 and path.suffix == ".jinja"
        if top_level or named_template:
            if named_template:
                (out_dir / CHAT_TEMPLATE_DIR).mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
            copy_private(path, out_dir / rel)
            copied.append(rel)
    return copied


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Progress:
    """Calls the user's callback, or prints at most every `_PROGRESS_INTERVAL_S` to stderr."""

    def __init__(self, progress: bool | ProgressFn, total: int):
        self.callback = progress if callable(progress) else None
        self.printing = progress is True
        self.total = total
        self.start = self.last_print = time.perf_counter()

    def update(self, done: int, final: bool = False) -> None:
        if self.callback is not None:
            self.callback(done, self.total)
        if self.printing:
            now = time.perf_counter()
            if now - self.last_print >= _PROGRESS_INTERVAL_S or final:
                self.last_print = now
                mb_s = done / max(now - self.start, 1e-9) / 1e6
                print(f"\rthaw convert: {done / 1e6:,.1f} / {self.total / 1e6:,.1f} MB ({mb_s:,.0f} MB/s)",
                      end="\n" if final else "", file=sys.stderr, flush=True)


def _write_partitions(tmp_dir: Path, placed: list[tuple[_SourceTensor, TensorEntry]], chunk_bytes: int,
                      progress: _Progress) -> list[PartitionEntry]:
    partitions: list[PartitionEntry] = []
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        writer: PartitionWriter | None = None
        for source, entry in placed:
            if writer is None or writer.partition != entry.partition:
                if writer is not None:
                    partitions.append(writer.finish())
                writer = PartitionWriter(tmp_dir / PARTITION_FILE_TEMPLATE.format(entry.partition), entry.partition,
                                         chunk_bytes)
                stack.callback(writer.abort)
            if source.file not in handles:
                handles[source.file] = stack.enter_context(safe_open(str(source.file), framework="pt"))
            tensor = handles[source.file].get_tensor(source.name)
            tensor = tensor.to(getattr(torch, entry.dtype)).contiguous()
            writer.pad_to(entry.offset)
            writer.write(tensor.reshape(-1).view(torch.uint8).numpy())  # [size] uint8
            del tensor
            progress.update(sum(p.size for p in partitions) + writer.offset)
        partitions.append(writer.finish())
    progress.update(sum(p.size for p in partitions), final=True)
    return partitions


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
                       partition_bytes: int = DEFAULT_PARTITION_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       progress: bool | ProgressFn = True, overwrite: bool = False) -> ThawIndex:
    """Convert the safetensors model in `hf_dir` into a thaw checkpoint at `out_dir`; returns its index.

    `dtype` ("float32", "float16", "bfloat16") casts every floating tensor; None keeps each
    tensor's dtype. `progress`: True prints to stderr, a callable gets (bytes_done, bytes_total),
    False is silent. A non-empty `out_dir` is refused unless `overwrite`, which replaces it
    atomically (the old one is renamed aside, the new one in, then the old one deleted).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if dtype is not None and dtype not in CAST_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported for conversion; "
                         f"use one of {', '.join(CAST_DTYPES)} or None")
    for name, value in (("partition_bytes", partition_bytes), ("chunk_bytes", chunk_bytes)):
        if not isinstance(value, int) or value <= 0 or value % ALIGNMENT_BYTES:
            raise ValueError(f"{name} is {value!r}; it must be a positive multiple of {ALIGNMENT_BYTES}")
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"model directory {hf_dir} does not exist")
    if out_dir.resolve() == hf_dir.resolve():
        raise ValueError(f"out_dir must differ from hf_dir ({hf_dir}): converting in place would delete the source")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")

    source_files = model_dir_files(hf_dir)  # refuses a symlink or an index entry leading outside hf_dir
    files = safetensors_files(hf_dir)
    num_layers, placed, total_bytes = _plan(_scan(files, dtype), partition_bytes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)  # left by a crashed run of a process with our pid
    tmp_dir.mkdir(mode=PRIVATE_DIR_MODE)
    try:
        partitions = _write_partitions(tmp_dir, placed, chunk_bytes, _Progress(progress, total_bytes))
        copied = _copy_extra_files(source_files, tmp_dir)
        for name in copied:
            _fsync_path(tmp_dir / name)
        index = ThawIndex(num_layers=num_layers, chunk_bytes=chunk_bytes, partitions=tuple(partitions),
                          tensors=tuple(e for _, e in placed),
                          source={"format": "safetensors", "files": [f.name for f in files], "dtype": dtype})
        _write_index(tmp_dir, index)
        _fsync_path(tmp_dir, directory=True)
        _install(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return index


def _write_index(tmp_dir: Path, index: ThawIndex) -> None:
    with os.fdopen(open_private(tmp_dir / INDEX_FILE), "w") as f:
        f.write(index.to_json())
        f.flush()
        os.fsync(f.fileno())


def _install(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished temporary dir to `out_dir`, replacing an existing one."""
    old_dir = None
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        old_dir = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        if old_dir.exists():
            shutil.rmtree(old_dir)
        os.rename(out_dir, old_dir)
    os.rename(tmp_dir, out_dir)  # replaces an empty out_dir too
    _fsync_path(out_dir.parent, directory=True)
    if old_dir is not None:
        if old_dir.is_dir():
            shutil.rmtree(old_dir)
        else:
            old_dir.unlink()
