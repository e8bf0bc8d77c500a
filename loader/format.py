"""The thaw checkpoint format: an index (`thaw_index.json`) over a few aligned partition files.

A thaw checkpoint directory holds

- ``partition_000.bin``, ``partition_001.bin``, ...: raw tensor bytes written back to back in
  *layer order* (embedding group, decoder layers 0..N-1, final group), each tensor at an offset
  aligned to `ALIGNMENT_BYTES` and each file padded to a multiple of it, so every read can use
  ``O_DIRECT`` and a loader can hand out layer k as soon as the bytes up to layer k landed;
- ``thaw_index.json`` (this module's `ThawIndex`): where each tensor lives, its dtype and shape,
  and an xxh3_64 checksum for every ``chunk_bytes`` slice of every partition, so a loader verifies
  each chunk right after it lands and never hands out a silently corrupted tensor;
- the model's non-weight files (config, tokenizer, ...) copied verbatim.

The idea of few large partitions read in big aligned chunks into one host buffer comes from
ServerlessLLM's ``sllm_store`` format; layer order (so serving can start before the last byte)
from BlitzScale. Parsing validates everything a loader relies on, so the loader can index the
buffer without re-checking bounds: a malformed index raises `CheckpointFormatError` naming the
field, never an IndexError deep in a read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_NAME = "thaw"
FORMAT_VERSION = 1
INDEX_FILE = "thaw_index.json"
ALIGNMENT_BYTES = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the block size
PARTITION_FILE_TEMPLATE = "partition_{:03d}.bin"

# Every dtype name the format may carry (torch attribute names).
SUPPORTED_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool",
)
_LAYER_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class CheckpointFormatError(ValueError):
    """The directory is not a readable thaw checkpoint (missing or malformed index, wrong version)."""


class ChecksumMismatchError(ValueError):
    """A chunk's bytes do not match the xxh3_64 recorded in the index (corruption on disk or in transit)."""


class TruncatedCheckpointError(ValueError):
    """A partition file is shorter than the index says (an interrupted copy or download)."""


def layer_of_tensor(name: str) -> int | None:
    """Decoder layer index of a tensor name, -1 for the embedding group, None for the final group.

    The final group's index is the number of decoder layers, known only once all names are seen,
    hence None here.
    """
    match = _LAYER_PATTERN.search(name)
    if match:
        return int(match.group(1))
    return -1 if "embed" in name else None


def torch_dtype(name: str) -> torch.dtype:
    if name not in SUPPORTED_DTYPES:
        raise CheckpointFormatError(f"unsupported dtype {name!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return getattr(torch, name)


def is_thaw_checkpoint(ckpt_dir: str | Path) -> bool:
    """True when `ckpt_dir` has a thaw index of a format and version this code reads.

    Cheap: reads only the index's header fields, not the partitions.
    """
    path = Path(ckpt_dir) / INDEX_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT_NAME and data.get("format_version") == FORMAT_VERSION


def _field(data: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise CheckpointFormatError(f"{where}: missing field {key!r}")
    value = data[key]
    # bool is an int subclass; a size of `true` is malformed, not 1.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise CheckpointFormatError(f"{where}: field {key!r} has {type(value).__name__} {value!r}, expected {kind}")
    return value


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: `size` bytes at `offset` in partition `partition`, belonging to layer `layer`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    partition: int
    offset: int
    size: int
    layer: int  # -1 embedding group, 0..N-1 decoder layers, N final group

    def __post_init__(self) -> None:
        where = f"tensor {self.name!r}"
        if self.dtype not in SUPPORTED_DTYPES:
            raise CheckpointFormatError(f"{where}: field 'dtype' is {self.dtype!r}; "
                                        f"supported: {', '.join(SUPPORTED_DTYPES)}")
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape):
            raise CheckpointFormatError(f"{where}: field 'shape' {list(self.shape)} must be non-negative integers")
        if self.partition < 0 or self.offset < 0 or self.layer < -1:
            raise CheckpointFormatError(f"{where}: fields 'partition', 'offset' must be >= 0 and 'layer' >= -1")
        if self.offset % ALIGNMENT_BYTES:
            raise CheckpointFormatError(f"{where}: field 'offset' {self.offset} is not a multiple of {ALIGNMENT_BYTES}")
        numel = 1
        for d in self.shape:
            numel *= d
        expected = numel * torch_dtype(self.dtype).itemsize
        if self.size != expected:
            raise CheckpointFormatError(f"{where}: field 'size' is {self.size} bytes "
                                        f"but {self.dtype}{list(self.shape)} needs {expected}")

    @classmethod
    def from_dict(cls, data: Any, position: int) -> TensorEntry:
        where = f"tensors[{position}]"
        shape = _field(data, "shape", list, where)
        return cls(
            name=_field(data, "name", str, where), dtype=_field(data, "dtype", str, where), shape=tuple(shape),
            partition=_field(data, "partition", int, where), offset=_field(data, "offset", int, where),
            size=_field(data, "size", int, where), layer=_field(data, "layer", int, where),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "partition": self.partition,
                "offset": self.offset, "size": self.size, "layer": self.layer}


@dataclass(frozen=True)
class ChunkEntry:
    """`size` bytes at `offset` of a partition, with their xxh3_64 as 16 lowercase hex digits."""

    offset: int
    size: int
    xxh3_64: str

    def __post_init__(self) -> None:
        if self.offset < 0 or self.size <= 0:
            raise CheckpointFormatError(f"chunk at offset {self.offset}: field 'size' {self.size} must be > 0 "
                                        f"and 'offset' >= 0")
        if not re.fullmatch(r"[0-9a-f]{16}", self.xxh3_64):
            raise CheckpointFormatError(f"chunk at offset {self.offset}: field 'xxh3_64' {self.xxh3_64!r} "
                                        f"is not 16 hex digits")

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ChunkEntry:
        return cls(offset=_field(data, "offset", int, where), size=_field(data, "size", int, where),
                   xxh3_64=_field(data, "xxh3_64", str, where))

    def to_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "size": self.size, "xxh3_64": self.xxh3_64}


@dataclass(frozen=True)
class PartitionEntry:
    """One partition file of `size` bytes, covered exactly by consecutive `chunks`."""

    file: str
    size: int
    chunks: tuple[ChunkEntry, ...]

    def __post_init__(self) -> None:
        # A bare file name: an index must not make a loader read outside its directory.
        if not self.file or "/" in self.file or "\\" in self.file or self.file in (".", ".."):
            raise CheckpointFormatError(f"partition: field 'file' {self.file!r} must be a plain file name")
        if self.size < 0 or self.size % ALIGNMENT_BYTES:
            raise CheckpointFormatError(f"partition {self.file}: field 'size' {self.size} "
                                        f"must be a multiple of {ALIGNMENT_BYTES}")
        covered = 0
        for i, chunk in enumerate(self.chunks):
            if chunk.offset != covered:
                raise CheckpointFormatError(f"partition {self.file}: field 'chunks'[{i}] starts at {chunk.offset}, "
                                            f"expected {covered}")
            covered += chunk.size
        if covered != self.size:
            raise CheckpointFormatError(f"partition {self.file}: field 'chunks' cover {covered} bytes, "
                                        f"expected {self.size}")

    @classmethod
    def from_dict(cls, data: Any, position: int) -> PartitionEntry:
        where = f"partitions[{position}]"
        chunks = _field(data, "chunks", list, where)
        return cls(file=_field(data, "file", str, where), size=_field(data, "size", int, where),
                   chunks=tuple(ChunkEntry.from_dict(c, f"{where}.chunks[{i}]") for i, c in enumerate(chunks)))

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "size": self.size, "chunks": [c.to_dict() for c in self.chunks]}


@dataclass(frozen=True)
class ThawIndex:
    """The parsed `thaw_index.json`; construction validates that it is self-consistent."""

    num_layers: int
    chunk_bytes: int
    partitions: tuple[PartitionEntry, ...]
    tensors: tuple[TensorEntry, ...]
    source: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise CheckpointFormatError(f"format_version {self.format_version} is not supported: this Thaw reads "
                                        f"version {FORMAT_VERSION}; reconvert the model with this version's converter")
        if self.num_layers < 0:
            raise CheckpointFormatError(f"field 'num_layers' is {self.num_layers}, must be >= 0")
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGNMENT_BYTES:
            raise CheckpointFormatError(f"field 'chunk_bytes' {self.chunk_bytes} "
                                        f"must be a positive multiple of {ALIGNMENT_BYTES}")
        for p in self.partitions:
            sizes = [c.size for c in p.chunks]
            if any(s > self.chunk_bytes for s in sizes) or any(s != self.chunk_bytes for s in sizes[:-1]):
                raise CheckpointFormatError(f"partition {p.file}: field 'chunks' must be {self.chunk_bytes} bytes "
                                            f"each, the last one shorter")
        if len({p.file for p in self.partitions}) != len(self.partitions):
            raise CheckpointFormatError("field 'partitions' names a file twice")
        names: set[str] = set()
        end_in_partition = [0] * len(self.partitions)
        for t in self.tensors:
            if t.name in names:
                raise CheckpointFormatError(f"field 'tensors' lists {t.name!r} twice")
            names.add(t.name)
            if t.partition >= len(self.partitions):
                raise CheckpointFormatError(f"tensor {t.name!r}: field 'partition' {t.partition} "
                                            f"but there are {len(self.partitions)} partitions")
            if t.layer > self.num_layers:
                raise CheckpointFormatError(f"tensor {t.name!r}: field 'layer' {t.layer} "
                                            f"is above num_layers {self.num_layers}")
            # Tensors appear in file order without overlap; this also bounds every read inside its partition.
            if t.offset < end_in_partition[t.partition]:
                raise CheckpointFormatError(f"tensor {t.name!r}: field 'offset' {t.offset} "
                                            f"overlaps the previous tensor")
            end_in_partition[t.partition] = t.offset + t.size
            partition = self.partitions[t.partition]
            if t.offset + t.size > partition.size:
                raise CheckpointFormatError(f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.size}) run past "
                                            f"{partition.file} ({partition.size} bytes)")

    @property
    def total_bytes(self) -> int:
        return sum(p.size for p in self.partitions)

    def tensors_in_layer(self, layer: int) -> list[TensorEntry]:
        return [t for t in self.tensors if t.layer == layer]

    def tensors_overlapping(self, partition: int, start: int, end: int) -> list[str]:
        """Names of the tensors with bytes in [start, end) of partition `partition`."""
        return [t.name for t in self.tensors
                if t.partition == partition and t.size > 0 and t.offset < end and start < t.offset + t.size]

    @classmethod
    def from_dict(cls, data: Any, origin: str = INDEX_FILE) -> ThawIndex:
        if not isinstance(data, dict):
            raise CheckpointFormatError(f"{origin}: expected a JSON object, found {type(data).__name__}")
        fmt = data.get("format")
        if fmt != FORMAT_NAME:
            raise CheckpointFormatError(f"{origin}: field 'format' is {fmt!r}, expected {FORMAT_NAME!r}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(f"{origin}: format_version {version!r} is not supported: this Thaw reads "
                                        f"version {FORMAT_VERSION}; reconvert the model with this version's converter")
        try:
            return cls(
                num_layers=_field(data, "num_layers", int, origin),
                chunk_bytes=_field(data, "chunk_bytes", int, origin),
                partitions=tuple(PartitionEntry.from_dict(p, i)
                                 for i, p in enumerate(_field(data, "partitions", list, origin))),
                tensors=tuple(TensorEntry.from_dict(t, i) for i, t in enumerate(_field(data, "tensors", list, origin))),
                source=_field(data, "source", dict, origin), format_version=version,
            )
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"{origin}: {exc}") from None

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> ThawIndex:
        path = Path(ckpt_dir) / INDEX_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise CheckpointFormatError(f"{path} not found: {ckpt_dir} is not a thaw checkpoint "
                                        f"(convert it with loader.convert_checkpoint)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointFormatError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(data, origin=str(path))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "format_version": self.format_version, "num_layers": self.num_layers,
            "chunk_bytes": self.chunk_bytes, "partitions": [p.to_dict() for p in self.partitions],
            "tensors": [t.to_dict() for t in self.tensors], "source": self.source,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)
