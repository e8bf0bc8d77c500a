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
user-wide directory is used. A current build is imported directly, without PyTorch's build lock
(which `load` takes even when there is nothing to build), and a lock older than any build could
take is removed before a build. If the build is impossible (no compiler), `try_build_cpu_extension`
says why and every caller uses its PyTorch path: slower, same results.

Each instruction-set level is a build of its own (`kernels.cpu_isa`: avx512bf16, avx512, avx2,
baseline; the module ``thaw_cpu_kernels_<level>`` in ``.build/torch-<version>/<level>/``), and a
process loads the best level its CPU runs: set-up builds that one, and
``python -m kernels --all`` builds every level (an image that runs on any x86-64).

``-ffp-contract=off``: the fused element-wise ops promise PyTorch's rounding, and a multiply-add
contracted into one FMA would round once where PyTorch rounds twice. The decode attention kernel's
AVX-512 path writes its FMAs explicitly (its results are held to the reference within a tolerance).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from kernels.cpu_isa import IsaLevel, best_isa, level_named, levels

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "cpu_extension_module.cpp", "cpu_decode_attention.cpp", "cpu_fused_ops.cpp", "cpu_gemv.cpp",
    "cpu_prefill_attention.cpp", "cpu_prefill_attention_f32.cpp"))


MODULE_PREFIX = "thaw_cpu_kernels"
STALE_LOCK_S = 600.0  # a build takes ~1 min; a lock this old was left by a process that died


COMMON_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)


def module_name(level: IsaLevel) -> str:
    """The extension module of one level's build (each level is a module of its own)."""
    return f"{MODULE_PREFIX}_{level.name}"


def cflags(level: IsaLevel) -> tuple[str, ...]:
    return (*COMMON_CFLAGS, *level.cflags)


@functools.cache  # one build check per process and level: the compiled module is immutable
def build_cpu_extension(verbose: bool = False, level: IsaLevel | None = None):
    """Loads the cached build of the C++ CPU kernels for `level` (the best this CPU runs,
    `cpu_isa.best_isa`), or compiles it first; raises on failure."""
    from torch.utils.cpp_extension import load

    level = level if level is not None else best_isa()
    name = module_name(level)
    directory = _build_directory(level)
    if directory is not None:
        built = _load_if_current(Path(directory), level)
        if built is not None:
            return built
        _drop_stale_lock(Path(directory))
    module = load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(cflags(level)),
        extra_ldflags=list(LDFLAGS),
        build_directory=directory,
        verbose=verbose,
    )
    if directory is not None:  # what this build was made from, for `_load_if_current`
        (Path(directory) / f"{name}.stamp").write_text(_inputs_key(level), encoding="utf-8")
    return module


def _inputs_key(level: IsaLevel) -> str:
    """What a build is made from: the sources, the headers they include, the flags."""
    import hashlib

    digest = hashlib.sha256(repr((cflags(level), LDFLAGS, torch.__version__)).encode())
    for path in (*SOURCES, *sorted(Path(__file__).parent.glob("*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _load_if_current(directory: Path, level: IsaLevel):
    """The built module when it was made from today's sources and flags (its stamp says so),
    imported directly; None when it must be (re)built. PyTorch's `load` takes its build lock even
    to find that nothing needs building, so a process killed in that second (an out-of-memory kill
    while a worker starts) left the lock and every later worker waited on it for ever; a current
    build is now loaded without the lock."""
    import importlib.util

    name = module_name(level)
    library = directory / f"{name}.so"
    try:
        current = (directory / f"{name}.stamp").read_text(encoding="utf-8") == _inputs_key(level)
    except OSError:  # built before stamps, or not built yet: load() checks (and stamps it)
        return None
    if not current or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _drop_stale_lock(directory: Path) -> None:
    """Removes a build lock older than `STALE_LOCK_S`: its builder died (no build takes that long),
    and PyTorch would wait on it for ever."""
    import time

    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:  # no lock, or another process removed it first
        pass


def _build_directory(level: IsaLevel) -> str | None:
    """This checkout's build cache (per torch version and level), or None (PyTorch's default)
    when the checkout is read-only."""
    directory = SOURCES[0].parent / ".build" / f"torch-{torch.__version__}" / level.name
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(directory)


@functools.cache
def try_build_cpu_extension() -> tuple[object | None, str | None]:
    """(module, None) if the kernels are usable here (the best level this CPU runs), else
    (None, why not)."""
    try:
        return build_cpu_extension(), None
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch paths
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"


def main(argv: list[str] | None = None) -> int:
    """``python -m kernels [--all | --level NAME]``: build (or find current) the
    kernels for this CPU's level, one named level, or every level (an image for any x86-64)."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m kernels", description=main.__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every level this kind of machine has")
    which.add_argument("--level", choices=[level.name for level in levels()], help="one level")
    args = parser.parse_args(argv)
    chosen = levels() if args.all else (level_named(args.level),) if args.level else (best_isa(),)
    for level in chosen:
        start = time.perf_counter()
        try:
            build_cpu_extension(level=level)
        except Exception as exc:  # noqa: BLE001 - say which level failed and why, then stop
            print(f"CPU kernels for {level.name} ({' '.join(level.cflags)}): failed: {exc}", file=sys.stderr)
            return 1
        print(f"CPU kernels for {level.name} ({' '.join(level.cflags)}): ready in {time.perf_counter() - start:.1f} s")
    return 0

