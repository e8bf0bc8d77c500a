"""Which build of the CPU kernels a machine runs: its instruction-set level, chosen at run time.

The kernels were compiled with ``-march=native``, so a build (and an image that carries one)
ran only on the CPU type that made it; on another, the first kernel call could die of SIGILL.
Now each build targets one named level, from the x86-64 psABI's levels plus AVX512-BF16 (the
bf16 prefill kernel's instructions):

========== ============================== =============================================
level      compiler flags                 the CPU needs (``/proc/cpuinfo`` flags)
========== ============================== =============================================
avx512bf16 -march=x86-64-v4 -mavx512bf16  avx512f/bw/vl/dq/cd and avx512_bf16
avx512     -march=x86-64-v4               avx512f/bw/vl/dq/cd
avx2       -march=x86-64-v3               avx2, fma, bmi2, f16c, movbe
baseline   -march=x86-64-v2               sse4.2, popcnt (every x86-64 CPU since ~2009)
========== ============================== =============================================

`best_isa` picks the highest level this CPU supports; each level's build is a module of its own
(`cpu_extension`), so an image may carry several (``python -m kernels --all``) and
every node loads the one it can run. The kernels' sources choose their code by the macros each
level defines (``__AVX512F__``, ``__AVX512BF16__``), so a lower level is the same kernels with
fewer vector paths, not other results. On a CPU that is not x86-64 there is one level, ``native``.

``THAW_CPU_ISA=<level>`` forces a level (no higher than the CPU's: a test of a lower build, or
an operator who wants one build on a mixed fleet).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "THAW_CPU_ISA"

_V4 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
_V3 = frozenset({"avx2", "fma", "bmi2", "f16c", "movbe", "avx"})
_V2 = frozenset({"sse4_2", "popcnt"})


@dataclass(frozen=True)
class IsaLevel:
    """One build target: its name, the flags it is compiled with, the CPU flags it needs."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]


X86_LEVELS = (
    IsaLevel("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), _V4 | {"avx512_bf16"}),
    IsaLevel("avx512", ("-march=x86-64-v4",), _V4),
    IsaLevel("avx2", ("-march=x86-64-v3",), _V3),
    IsaLevel("baseline", ("-march=x86-64-v2",), _V2),
)
NATIVE = IsaLevel("native", ("-march=native",), frozenset())


def is_x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def levels(machine: str | None = None) -> tuple[IsaLevel, ...]:
    """The levels a build may target on this kind of machine, best first."""
    return X86_LEVELS if is_x86_64(machine) else (NATIVE,)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def level_named(name: str, machine: str | None = None) -> IsaLevel:
    for level in levels(machine):
        if level.name == name:
            return level
    raise ValueError(f"{ISA_ENV}={name!r} is not a CPU kernel level here; choose one of "
                     f"{', '.join(level.name for level in levels(machine))}")


def best_isa(flags: frozenset[str] | None = None, machine: str | None = None,
             forced: str | None = None) -> IsaLevel:
    """The highest level these CPU `flags` run (this CPU's by default), or the `forced` one
    (``THAW_CPU_ISA`` by default; "" forces none), refused when the CPU cannot run it."""
    candidates = levels(machine)
    if not is_x86_64(machine):
        return candidates[0]
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get(ISA_ENV, "") if forced is None else forced  # "": none forced
    runnable = [level for level in candidates if level.needs <= flags]
    if forced:
        level = level_named(forced, machine)
        if flags and level not in runnable:
            raise ValueError(f"{ISA_ENV}={forced!r}: this CPU lacks {', '.join(sorted(level.needs - flags))}")
        return level
    if not flags:  # no /proc/cpuinfo: the one level every x86-64 CPU this century runs
        return candidates[-1]
    return runnable[0] if runnable else candidates[-1]
