"""The manifest of a parameter stream: which tensor lives where in one flat buffer, and the chunks.

The source of a layer stream sends this plan first, so each receiver can allocate *one*
destination buffer of `total_bytes` and hand out every tensor as a zero-copy view into it -- the
same shape of result as the SSD loader's. Tensors are laid out in layer order (-1 embedding,
0..N-1 decoder layers, N final group), each at an offset aligned to `TENSOR_ALIGNMENT_BYTES` so a
``uint8`` slice can be viewed as any dtype. Each layer's byte range is cut into chunks of at most
`chunk_bytes`; a chunk never spans two layers, so "layer k is ready" is exactly "the first
`layer_chunk_end[k]` chunks have landed", one counter for all layers.

Both ends derive the chunks from the plan, so only the tensor table crosses the wire (JSON). A
received plan is validated like a thaw index: a malformed one raises ValueError naming the field,
never an IndexError in a view later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from loader.format import SUPPORTED_DTYPES, layer_of_tensor, torch_dtype

TENSOR_ALIGNMENT_BYTES = 64  # >= every dtype's itemsize, and a cache line
_PLAN_FORMAT = "thaw-stream-plan"
_PLAN_VERSION = 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class StreamTensor:
    """One tensor: `size` bytes at `offset` of the flat buffer, in layer `layer`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layer: int  # -1 embedding group, 0..N-1 decoder layers, N final group
    offset: int
    size: int


@dataclass(frozen=True)
class StreamChunk:
    """`size` bytes at `offset` of the flat buffer, all of them in layer `layer`: one message."""

    layer: int
    offset: int
    size: int


@dataclass(frozen=True)
class StreamPlan:
    """The layout of one stream; construction validates it (ValueError naming the field)."""

    transfer_id: str
    num_layers: int  # decoder layers; the final group is layer `num_layers`
    chunk_bytes: int
    total_bytes: int
    tensors: tuple[StreamTensor, ...]  # in layer order, offsets increasing

    def __post_init__(self) -> None:
        if not self.transfer_id:
            raise ValueError("stream plan: field 'transfer_id' is empty")
        if self.num_layers < 0:
            raise ValueError(f"stream plan: field 'num_layers' is {self.num_layers}, must be >= 0")
        if self.chunk_bytes <= 0:
            raise ValueError(f"stream plan: field 'chunk_bytes' is {self.chunk_bytes}, must be > 0")
        end, last_layer, names = 0, -1, set()
        for t in self.tensors:
            where = f"stream plan: tensor {t.name!r}"
            if t.name in names:
                raise ValueError(f"{where} is listed twice")
            names.add(t.name)
            if t.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"{where}: dtype {t.dtype!r} is not one of {', '.join(SUPPORTED_DTYPES)}")
            if not -1 <= t.layer <= self.num_layers or t.layer < last_layer:
                raise ValueError(f"{where}: layer {t.layer} is out of range -1..{self.num_layers} or out of order")
            if t.offset < end or t.offset % TENSOR_ALIGNMENT_BYTES:
                raise ValueError(f"{where}: offset {t.offset} overlaps the previous tensor or is not a multiple "
                                 f"of {TENSOR_ALIGNMENT_BYTES}")
            numel = 1
            for d in t.shape:
                if d < 0:
                    raise ValueError(f"{where}: shape {list(t.shape)} has a negative dimension")
                numel *= d
            if t.size != numel * torch_dtype(t.dtype).itemsize:
                raise ValueError(f"{where}: size {t.size} does not match {t.dtype}{list(t.shape)}")
            end, last_layer = t.offset + t.size, t.layer
        if self.total_bytes < end:
            raise ValueError(f"stream plan: field 'total_bytes' {self.total_bytes} is below the end of the "
                             f"last tensor ({end})")

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, transfer_id: str, chunk_bytes: int,
                     num_layers: int | None = None) -> StreamPlan:
        """Lay `tensors` out in layer order. Layers come from the tensor names, as in the converter:
        ``...layers.<k>....`` is layer k, names with ``embed`` are -1, the rest the final group.
        `num_layers` defaults to one more than the highest decoder layer named."""
        found: list[tuple[int | None, int, str, torch.Tensor]] = []
        for position, (name, tensor) in enumerate(tensors.items()):
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; a stream carries only "
                                 f"{', '.join(SUPPORTED_DTYPES)}")
            found.append((layer_of_tensor(name), position, name, tensor))
        highest = max((layer for layer, *_ in found if layer is not None and layer >= 0), default=-1)
        if num_layers is None:
            num_layers = highest + 1
        if highest >= num_layers:
            raise ValueError(f"num_layers is {num_layers} but tensors name decoder layer {highest}")
        placed, offset = [], 0
        for layer, _, name, tensor in sorted(found, key=lambda f: (num_layers if f[0] is None else f[0], f[1])):
            size = tensor.numel() * tensor.element_size()
            placed.append(StreamTensor(name=name, dtype=str(tensor.dtype).removeprefix("torch."),
                                       shape=tuple(tensor.shape), layer=num_layers if layer is None else layer,
                                       offset=offset, size=size))
            offset = _round_up(offset + size, TENSOR_ALIGNMENT_BYTES)
        return cls(transfer_id=transfer_id, num_layers=num_layers, chunk_bytes=chunk_bytes, total_bytes=offset,
                   tensors=tuple(placed))

    @property
    def layers(self) -> range:
        return range(-1, self.num_layers + 1)

    @cached_property
    def chunks(self) -> tuple[StreamChunk, ...]:
        """Every message after the plan, in send order: each layer's bytes cut at `chunk_bytes`."""
        chunks = []
        for layer in self.layers:
            members = self.tensors_in_layer(layer)
            if not members:
                continue
            start, end = members[0].offset, members[-1].offset + members[-1].size
            for offset in range(start, end, self.chunk_bytes):
                chunks.append(StreamChunk(layer=layer, offset=offset, size=min(self.chunk_bytes, end - offset)))
        return tuple(chunks)

    @cached_property
    def layer_chunk_end(self) -> dict[int, int]:
        """layer -> number of chunks that must have landed for that layer (and all before it) to be in."""
        per_layer = {layer: 0 for layer in self.layers}
        for c in self.chunks:
            per_layer[c.layer] += 1
        ends, landed = {}, 0
        for layer in self.layers:
            landed += per_layer[layer]
            ends[layer] = landed
        return ends

    def tensors_in_layer(self, layer: int) -> list[StreamTensor]:
        return [t for t in self.tensors if t.layer == layer]

    def view(self, buffer: torch.Tensor, t: StreamTensor) -> torch.Tensor:
        """Tensor `t` as a zero-copy view into `buffer` ([total_bytes] uint8)."""
        return buffer[t.offset: t.offset + t.size].view(torch_dtype(t.dtype)).view(t.shape)

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format": _PLAN_FORMAT, "version": _PLAN_VERSION, "transfer_id": self.transfer_id,
            "num_layers": self.num_layers, "chunk_bytes": self.chunk_bytes, "total_bytes": self.total_bytes,
            "tensors": [[t.name, t.dtype, list(t.shape), t.layer, t.offset, t.size] for t in self.tensors],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StreamPlan:
        try:
            raw: Any = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"stream plan is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != _PLAN_FORMAT or raw.get("version") != _PLAN_VERSION:
            raise ValueError(f"stream plan has format {raw.get('format') if isinstance(raw, dict) else raw!r} "
                             f"version {raw.get('version') if isinstance(raw, dict) else None!r}; this Thaw reads "
                             f"{_PLAN_FORMAT!r} version {_PLAN_VERSION} (are both ends the same Thaw version?)")
        try:
            tensors = tuple(StreamTensor(name=str(n), dtype=str(d), shape=tuple(int(x) for x in s), layer=int(k),
                                         offset=int(o), size=int(z)) for n, d, s, k, o, z in raw["tensors"])
            return cls(transfer_id=str(raw["transfer_id"]), num_layers=int(raw["num_layers"]),
                       chunk_bytes=int(raw["chunk_bytes"]), total_bytes=int(raw["total_bytes"]), tensors=tensors)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"stream plan is malformed: {type(exc).__name__} {exc}") from None
