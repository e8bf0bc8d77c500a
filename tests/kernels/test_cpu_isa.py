"""`kernels.cpu_isa`: the CPU kernels' build level is chosen from the CPU's flags at run time (the
highest it runs, or a forced lower one; never one it cannot run), and each level's flags make the
compiler define exactly the macros the kernels choose their vector paths by."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from kernels.cpu_isa import ISA_ENV, X86_LEVELS, best_isa, cpu_flags, level_named, levels

V4 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
V3 = {"avx2", "fma", "bmi2", "f16c", "movbe", "avx"}
V2 = {"sse4_2", "popcnt"}


@pytest.mark.parametrize("flags, want", [
    (V2 | V3 | V4 | {"avx512_bf16", "amx_bf16"}, "avx512bf16"),  # Sapphire Rapids
    (V2 | V3 | V4, "avx512"),  # Skylake-SP
    (V2 | V3, "avx2"),  # Zen 2, Haswell
    (V2, "baseline"),
    (V2 | {"avx2"}, "baseline"),  # AVX2 without FMA is not v3
])
def test_the_highest_level_the_cpu_runs_is_chosen(flags, want):
    assert best_isa(frozenset(flags), machine="x86_64", forced="").name == want


def test_a_forced_level_is_taken_only_when_the_cpu_runs_it(monkeypatch):
    flags = frozenset(V2 | V3)
    assert best_isa(flags, machine="x86_64", forced="baseline").name == "baseline"
    with pytest.raises(ValueError, match="THAW_CPU_ISA='avx512': this CPU lacks avx512bw, avx512cd"):
        best_isa(flags, machine="x86_64", forced="avx512")
    with pytest.raises(ValueError, match="not a CPU kernel level here; choose one of avx512bf16, avx512, avx2, baseline"):
        best_isa(flags, machine="x86_64", forced="sse9")
    monkeypatch.setenv(ISA_ENV, "baseline")
    assert best_isa(flags, machine="x86_64").name == "baseline"


def test_other_machines_build_natively_and_no_cpuinfo_means_baseline(tmp_path):
    assert [level.name for level in levels("aarch64")] == ["native"]
    assert best_isa(frozenset(), machine="aarch64").cflags == ("-march=native",)
    assert best_isa(frozenset(), machine="x86_64", forced="").name == "baseline"
    assert cpu_flags(tmp_path / "missing") == frozenset()
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n")
    assert cpu_flags(tmp_path / "cpuinfo") == {"fpu", "sse4_2", "avx2"}
    assert level_named("avx2", "x86_64").cflags == ("-march=x86-64-v3",)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("level", X86_LEVELS, ids=lambda level: level.name)
def test_each_level_defines_the_macros_its_kernels_are_chosen_by(level):
    macros = subprocess.run(["g++", *level.cflags, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                            text=True, check=True, timeout=60).stdout
    defined = {name for name in ("__AVX512F__", "__AVX512BF16__", "__AVX2__", "__FMA__", "__SSE4_2__")
               if f"#define {name} " in macros}
    assert defined == {"avx512bf16": {"__AVX512F__", "__AVX512BF16__", "__AVX2__", "__FMA__", "__SSE4_2__"},
                       "avx512": {"__AVX512F__", "__AVX2__", "__FMA__", "__SSE4_2__"},
                       "avx2": {"__AVX2__", "__FMA__", "__SSE4_2__"},
                       "baseline": {"__SSE4_2__"}}[level.name]
