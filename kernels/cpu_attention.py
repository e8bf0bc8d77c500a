"""The CPU serving backend: the reference for prefill rows, a C++ kernel for decode rows.

Decode steps dominate a continuous-batching engine, and on CPU the reference's decode path
spends most of its time copying each sequence's context out of the block pool for SDPA.
`cpu_decode_attention.cpp` reads K/V through the block table instead (float32 or bfloat16 storage,
float32 arithmetic, exact two-pass softmax, parallel over sequence x KV head, Gemma 2's score
soft-capping when asked).
It is compiled on first use with PyTorch's extension builder (g++ and ninja) — ``infra/setup.sh`` builds it once at install. The
build is cached in the checkout (``kernels/.build/``, ignored by git), not in the user-wide
``~/.cache/torch_extensions``: two checkouts sharing that directory rebuild it for each other in
turn, and a process killed during such a rebuild (a chaos test's SIGKILL) leaves PyTorch's build
lock behind, on which every later load waits for ever. Where the checkout is not writable the
user-wide directory is used. If the build is impossible (no compiler),
`build_cpu_decode_extension` says why and the engine uses the reference everywhere: slower, same
results.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.attention_backend import check_gqa_heads, check_softcap
from kernels.attention_metadata import AttentionMetadata
from kernels.reference import ReferenceAttentionBackend

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
# Storage dtypes the C++ kernel reads (others, e.g. float16, take the reference path).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache  # one build check per process: the compiled module is immutable
def build_cpu_decode_extension(verbose: bool = False):
    """Compiles (or loads the cached build of) the C++ decode kernel; raises on failure."""
    from torch.utils.cpp_extension import load

    return load(
        name="thaw_cpu_decode_attention",
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=_build_directory(),
        verbose=verbose,
    )


def _build_directory() -> str | None:
    """This checkout's build cache for the kernel (per torch version), or None (PyTorch's default)
    when the checkout is read-only."""
    directory = SOURCE.parent / ".build" / f"torch-{torch.__version__}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(directory)


@functools.cache
def try_build_cpu_decode_extension() -> tuple[object | None, str | None]:
    """(module, None) if the kernel is usable here, else (None, why not)."""
    try:
        return build_cpu_decode_extension(), None
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"


@dataclass(frozen=True)
class _DecodePlan:
    rows: torch.Tensor  # [Bd] int64 query rows of the decode sequences
    block_tables: torch.Tensor  # [Bd, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [Bd] int32


class CpuAttentionBackend(ReferenceAttentionBackend):
    """`AttentionBackend` for CPU serving; identical results to the reference (tested)."""

    name = "cpu"

    def __init__(self, extension) -> None:
        super().__init__()
        self._ext = extension

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        if (query.dtype not in KERNEL_DTYPES or not query.dtype == key_cache.dtype == value_cache.dtype
                or 1 not in metadata.query_lens_host):
            return super().paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, softcap)
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        check_gqa_heads(num_heads, num_kv_heads)
        check_softcap(softcap)
        decode = self._cached(metadata, ("decode",), lambda: self._decode_plan(metadata))
        prefill = self._plan_for(metadata, key_cache.shape[1], sliding_window, query.device, include_decode=False)
        out = self._run(prefill, query, key_cache, value_cache, scale, softcap)
        q = query.index_select(0, decode.rows)  # [Bd, Hq, D], contiguous
        o = torch.empty_like(q)
        # The kernel's "no window" and "no cap" are both 0.
        self._ext.paged_decode_attention(o, q, key_cache, value_cache, decode.block_tables, decode.seq_lens,
                                         float(scale), int(sliding_window or 0), float(softcap or 0.0))
        out.index_copy_(0, decode.rows, o)
        return out

    @staticmethod
    def _decode_plan(metadata: AttentionMetadata) -> _DecodePlan:
        ids = [b for b, q_len in enumerate(metadata.query_lens_host) if q_len == 1]
        starts = [0]
        for q_len in metadata.query_lens_host:
            starts.append(starts[-1] + q_len)
        index = torch.tensor(ids, device=metadata.block_tables.device)
        return _DecodePlan(
            rows=torch.tensor([starts[b] for b in ids], device=metadata.block_tables.device),
            block_tables=metadata.block_tables.index_select(0, index).to(torch.int32).contiguous(),
            seq_lens=metadata.seq_lens.index_select(0, index).to(torch.int32).contiguous(),
        )
