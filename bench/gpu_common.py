"""Small helpers shared by the GPU benchmarks (`bench/engine_gpu.py`, `bench/coldstart_gpu.py`)
and their runner (`bench/gpu_suite.py`): the reasons peers cannot run on the lent GPU machine,
the one-line skip when there is no CUDA device, and where a benchmark may put files that must
live on a disk (not in memory) and how to push them out of the page cache.

Everything here is standard library only, so the suite's ``--dry-run`` and a benchmark's child
process that must not pay for extra imports can use it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Why the named peers are not measured on the lent GPU machine (no network there; at most 64 MiB of
# files travel with the working tree).
VLLM_NOT_RUN = ("not run: vLLM's CUDA build (a wheel of several hundred MB with its CUDA kernels, plus its "
                "dependencies) cannot reach the lent GPU machine, which has no network and receives at most "
                "64 MiB of files; the engine is compared with transformers.generate on the same GPU instead")
RAY_SERVE_NOT_RUN = ("not run: the ray wheel (~72 MB) is above the 64 MiB the lent GPU machine can receive and "
                     "the machine has no network, so Ray Serve cannot start there; the baseline is its replica's "
                     "in-process path (bench/transformers_replica.py: from_pretrained in bf16, to the GPU, one "
                     "greedy token) in a fresh process, which leaves out Serve's own replica start and "
                     "autoscaling delay (see BENCHMARKS.md, cold start) and so flatters the baseline")

MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs"})


def emit(line: dict) -> None:
    """One JSON line on stdout, flushed at once (a runner that kills a slow benchmark keeps it)."""
    print(json.dumps(line), flush=True)


def log(prefix: str, message: str) -> None:
    print(f"[{prefix}] {message}", file=sys.stderr, flush=True)


def cuda_missing_reason(device: str) -> str | None:
    """Why `device` cannot be used (a CUDA device asked for on a machine without one), else None."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: this benchmark measures the engine on a GPU (pass --device cpu for a smoke run)"
    return None


def fs_type(path: Path) -> str:
    """The filesystem type holding `path` as `stat -f` names it ("tmpfs", "ext2/ext3", "xfs", ...)."""
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def disk_work_dir(preferred: Path | None, min_free_bytes: int) -> Path:
    """A directory on a disk-backed filesystem with `min_free_bytes` free: `preferred` when it
    qualifies, else the temp dir, /var/tmp or the repository root (the first that does).
    Raises ValueError naming what was tried when none does."""
    candidates = [preferred] if preferred is not None else []
    candidates += [Path(tempfile.gettempdir()), Path("/var/tmp"), ROOT]
    tried = []
    for candidate in candidates:
        if not candidate.is_dir():
            tried.append(f"{candidate} (not a directory)")
            continue
        kind, free = fs_type(candidate), shutil.disk_usage(candidate).free
        if kind in MEMORY_FS_TYPES or free < min_free_bytes:
            tried.append(f"{candidate} ({kind}, {free / 1e9:.1f} GB free)")
            continue
        return candidate
    raise ValueError(f"no disk-backed directory with {min_free_bytes / 1e9:.1f} GB free: tried "
                     f"{'; '.join(tried)}; pass --work-dir on a disk")


def drop_page_cache(root: Path) -> str:
    """Pushes every file under `root` out of the page cache; returns how: "drop_caches" (as root,
    the whole page cache) or "fadvise" (POSIX_FADV_DONTNEED per file, what an unprivileged user can do)."""
    os.sync()
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:  # a container's read-only /proc/sys: fall through
            pass
    from bench.tiers import drop_from_page_cache  # standard library only

    drop_from_page_cache(root)
    return "fadvise"
