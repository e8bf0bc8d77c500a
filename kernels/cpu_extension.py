"""Thaw's C++ CPU kernels as one PyTorch extension: built once, cached in the checkout.

One extension holds every CPU kernel (`cpu_decode_attention.cpp`: paged decode attention;
`cpu_fused_ops.cpp`: RMSNorm (alone or after the residual add), SiLU-and-multiply, rotary
embedding; `cpu_gemv.cpp`: float32
linear layers at 1-4 rows; `cpu_prefill_attention.cpp`: bf16 flash attention with AVX512-BF16 and
the entry points of `cpu_prefill_attention_f32.cpp`, its float32 twin with query rows in lanes;
`cpu_vec_math.h`: the vector math they share; `cpu_extension_module.cpp` binds them), so there is
one build (~40-60 s with g++ and ninja, done by ``infra/setup.sh`` at install) and one answer to
"is it usable here".

The build is cached in the checkout (``kernels/.build/``, ignored by git), not in the user-wide
``~/.cache/torch_extensions``: two checkouts sharing that directory rebuild it for each other in
turn, and a process killed during such a rebuild (a chaos test's SIGKILL) leaves PyTorch's build
lock behind, on which every later load waits for ever. Where the checkout is not writable the
user-wide directory is used. If the build is impossible (no compiler), `try_build_cpu_extension`
says why and every caller uses its PyTorch path: slower, same results.

``-ffp-contract=off``: the fused element-wise ops promise PyTorch's rounding, and a multiply-add
contracted into one FMA would round once where PyTorch rounds twice. The decode attention kernel's
AVX-512 path writes its FMAs explicitly (its results are held to the reference within a tolerance).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "cpu_extension_module.cpp", "cpu_decode_attention.cpp", "cpu_fused_ops.cpp", "cpu_gemv.cpp",
    "cpu_prefill_attention.cpp", "cpu_prefill_attention_f32.cpp"))


@functools.cache  # one build check per process: the compiled module is immutable
def build_cpu_extension(verbose: bool = False):
    """Compiles (or loads the cached build of) the C++ CPU kernels; raises on failure."""
    from torch.utils.cpp_extension import load

    return load(
        name="thaw_cpu_kernels",
        sources=[str(source) for source in SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        build_directory=_build_directory(),
        verbose=verbose,
    )


def _build_directory() -> str | None:
    """This checkout's build cache (per torch version), or None (PyTorch's default) when the
    checkout is read-only."""
    directory = SOURCES[0].parent / ".build" / f"torch-{torch.__version__}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(directory)


@functools.cache
def try_build_cpu_extension() -> tuple[object | None, str | None]:
    """(module, None) if the kernels are usable here, else (None, why not)."""
    try:
        return build_cpu_extension(), None
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch paths
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
