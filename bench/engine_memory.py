"""Engine memory benchmark: what a bfloat16 CPU engine keeps resident, against its checkpoint (#37).

A thaw checkpoint is loaded as views of one host buffer and every linear weight is then packed
for oneDNN; the engine releases each plain weight once it is packed (`loader.page_release`).
This builds the engine twice, each in a fresh process, and reports the resident memory the
engine added (RSS after ``Engine(...)`` less RSS before it) and the peak: with the release, and
with it turned off (every plain copy kept, as before #37). The floor is the checkpoint's bytes
plus the KV pool's: the least an engine that holds its weights once can keep resident.

    python bench/engine_memory.py [--quick | MODEL_DIR]

``--quick`` writes a ~90 MB bf16 Llama (CI smoke); MODEL_DIR is any bf16 thaw checkpoint (the
8B figures in BENCHMARKS.md came from the one bench/deploy.py writes). One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KV_BYTES = 64 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model_dir: str, keep_plain: bool) -> dict:
    """In this process: the engine's added resident bytes and the peak while it was built."""
    import worker.models.llama
    from worker import Engine, EngineConfig

    if keep_plain:
        worker.models.llama.release_pages = lambda tensor: 0
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _resident_bytes())
            done.wait(0.02)

    before = _resident_bytes()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    # Packed at load, so the figure is the engine's steady state (deferred, it would pack later).
    engine = Engine(model_dir, EngineConfig(kv_cache_bytes=KV_BYTES, cpu_prepack_defer_bytes=None))
    build_s = time.perf_counter() - start
    done.set()
    watcher.join()
    after = _resident_bytes()
    del engine
    return {"added_bytes": after - before, "peak_added_bytes": max(peak[0], after) - before, "build_s": build_s}


def run(model_dir: Path, keep_plain: bool) -> dict:
    result = subprocess.run([sys.executable, __file__, "--measure", str(model_dir)] + (["--keep-plain"] if keep_plain
                                                                                       else []),
                            capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {model_dir} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", type=Path, help="a bf16 thaw checkpoint")
    parser.add_argument("--quick", action="store_true", help="a ~90 MB bf16 model (CI smoke run)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--keep-plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(str(args.model_dir), args.keep_plain)))
        return 0
    if (args.model_dir is None) == (not args.quick):
        parser.error("give a MODEL_DIR or --quick")
    with tempfile.TemporaryDirectory(prefix="thaw-engine-memory-") as work:
        model_dir = args.model_dir
        if args.quick:
            from loader import convert_checkpoint
            from worker import DemoModelConfig, write_demo_model

            hf = write_demo_model(Path(work) / "hf", DemoModelConfig(
                hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=2048, dtype="bfloat16", vocab_size=8192))
            model_dir = Path(work) / "thaw"
            convert_checkpoint(hf, model_dir)
        checkpoint_bytes = sum(p.stat().st_size for p in model_dir.glob("partition_*.bin"))
        released, kept = run(model_dir, keep_plain=False), run(model_dir, keep_plain=True)
    floor = checkpoint_bytes + KV_BYTES
    print(json.dumps({
        "bench": "engine_memory", "mode": "quick" if args.quick else "full", "checkpoint_bytes": checkpoint_bytes,
        "kv_bytes": KV_BYTES, "floor_bytes": floor,
        "added_bytes": released["added_bytes"], "peak_added_bytes": released["peak_added_bytes"],
        "build_s": round(released["build_s"], 2),
        "kept_plain_added_bytes": kept["added_bytes"], "kept_plain_peak_added_bytes": kept["peak_added_bytes"],
        "ratio_to_floor": round(released["added_bytes"] / floor, 3),
        "kept_plain_ratio_to_floor": round(kept["added_bytes"] / floor, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
