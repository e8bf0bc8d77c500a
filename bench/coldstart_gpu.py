"""Cold start on a GPU, to the first token: Thaw's engine from the DRAM tier and from SSD, against
the in-replica path of a Ray Serve + transformers deployment.

One run writes a random-weight Llama with Llama-3.2-1B's body (hidden 2048, 16 layers, 32 query /
8 KV heads, intermediate 8192) and a 32000-token vocabulary, tied embeddings: 1.04B parameters,
2.08 GB in bf16 (``--quick``: a few MB). It converts it to the thaw format on a disk, copies that
into /dev/shm, or another tmpfs with room (the node's DRAM tier is tmpfs, which the loader maps
instead of reading), and times
each case in a FRESH process, ``repeats`` times interleaved (after one untimed round that fills
Triton's on-disk kernel cache and the loader's verification record, as a node that has served
before has them):

* ``thaw-dram`` / ``thaw-ssd``: the process first does what Thaw's spare worker does ahead of
  demand (`worker.serving.process_warmup`, `worker.loading.reserved_memory`): imports torch and the worker,
  creates the CUDA context and runs a tiny engine on the GPU once (for head sizes 64 and 128,
  which compiles or loads the Triton kernels and initialises cuBLAS). Then it reports ready; the
  parent puts the checkpoint in place (for SSD: dropped from the page cache, with
  ``echo 1 > /proc/sys/vm/drop_caches`` as root, else POSIX_FADV_DONTNEED per file) and says go;
  the clock runs from go over ``Engine(...)`` (load to the GPU) and the first token of a 128-token
  prompt (token ids, greedy).
* ``hf-replica``: what `bench/transformers_replica.py`'s replica does in its constructor and first
  request -- ``AutoModelForCausalLM.from_pretrained(bf16)``, ``.to("cuda")`` (``device_map`` needs
  accelerate, absent on the GPU machine), one forward pass, argmax -- in a fresh process, timed
  from the process start (interpreter, torch + transformers imports, CUDA init: what a new Serve
  replica pays) and from after the imports. Its safetensors file stays in the page cache (as a
  warm DRAM tier would keep it), which favours it.

Ray Serve itself cannot run on the lent GPU machine (see `bench.gpu_common.RAY_SERVE_NOT_RUN`),
so the baseline leaves out Serve's own replica start and autoscaling delay; that flatters the
baseline, so a ratio here understates Thaw's. ``ratio_to_baseline`` = hf-replica (from process
start) median / the case's median. Targets (issues 7, 26): >= 15x from DRAM, >= 5x from SSD.

    python bench/coldstart_gpu.py [--quick] [--device cuda] [--repeats N] [--work-dir DIR]

One JSON line per case on stdout, progress on stderr; without a CUDA device one skipped line, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Standard library only at module level: the baseline's child process runs this file too, and
# must pay for torch and transformers alone, as a Serve replica would.
from bench.gpu_common import (MEMORY_FS_TYPES, RAY_SERVE_NOT_RUN, cuda_missing_reason, disk_work_dir,  # noqa: E402
                              drop_page_cache, emit, fs_type, log)
from bench.tiers import read_into_page_cache  # noqa: E402 - standard library only at import

BENCH = "coldstart_gpu"
TARGETS = {"thaw-dram": 15.0, "thaw-ssd": 5.0}
BASELINE = "hf-replica-from-process-start"
CHILD_TIMEOUT_S = 240.0
SHM_DIR = Path("/dev/shm")  # the node's DRAM tier lives in tmpfs; this one first


@dataclass(frozen=True)
class ColdstartMode:
    name: str
    model_kwargs: dict  # DemoModelConfig(**model_kwargs)
    prompt_tokens: int
    repeats: int


FULL = ColdstartMode("full", dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
    vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=2048, dtype="bfloat16", seed=0),
    prompt_tokens=128, repeats=3)
QUICK = ColdstartMode("quick", dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    max_position_embeddings=512, dtype="bfloat16", init_std=0.1, seed=0), prompt_tokens=16, repeats=1)


def _log(message: str) -> None:
    log("bench/coldstart_gpu", message)


# ---- the child processes -------------------------------------------------------------------------


def _first_token(engine, prompt: list[int]) -> int:
    from worker import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                token = out.new_token_ids[0]
    return token


def warm_up_on(device: str) -> None:
    """What a GPU spare worker pays ahead of demand: a tiny engine on the device, per common head
    size (64, 128), written, converted to the thaw format, loaded and run for one token."""
    from loader import convert_checkpoint
    from worker import DemoModelConfig, Engine, EngineConfig, write_demo_model

    with tempfile.TemporaryDirectory(prefix="thaw-gpu-warmup-") as tmp:
        for hidden in (128, 256):  # 2 heads: head size 64, 128
            tiny = DemoModelConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=256, tokenizer_vocab_size=300,
                                   max_position_embeddings=256, dtype="bfloat16", init_std=0.1, seed=0)
            hf_dir = write_demo_model(Path(tmp) / f"hf{hidden}", tiny)
            convert_checkpoint(hf_dir, Path(tmp) / f"thaw{hidden}", progress=False)
            engine = Engine(Path(tmp) / f"thaw{hidden}", EngineConfig(device=device, dtype="bfloat16", num_kv_blocks=8))
            _first_token(engine, [5, 6, 7])
            del engine


def child_thaw(model_dir: Path, device: str, prompt: list[int]) -> None:
    """The spare: warm up, say ready, wait for go, then load and answer; prints its timings."""
    start = time.monotonic()
    import torch

    from worker import Engine, EngineConfig

    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # creates the CUDA context
        torch.cuda.synchronize()
    warm_up_on(device)
    emit({"ready": True, "warm_up_s": round(time.monotonic() - start, 3)})
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the parent went away before saying go")
    go = time.perf_counter()
    engine = Engine(model_dir, EngineConfig(device=device, dtype="bfloat16"))
    loaded = time.perf_counter()
    token = _first_token(engine, prompt)
    first = time.perf_counter()
    emit({"load_s": loaded - go, "first_token_s": first - go, "token": token, "load_report": engine.load_report})


def child_hf(model_dir: Path, device: str, prompt: list[int]) -> None:
    """The Serve replica's path; prints monotonic timestamps (the parent knows when it spawned us)."""
    import torch
    import transformers

    imported = time.monotonic()
    if device.startswith("cuda"):
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    cuda_ready = time.monotonic()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    loaded = time.monotonic()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt], device=device)).logits  # [1, T, V]
        token = int(logits[0, -1].argmax())  # waits for the GPU
    emit({"imported_at": imported, "cuda_ready_at": cuda_ready, "loaded_at": loaded, "first_token_at": time.monotonic(),
          "token": token})


# ---- the parent ----------------------------------------------------------------------------------


def _read_json(proc: subprocess.Popen, what: str) -> dict:
    """The child's next JSON line on stdout (other lines are passed on to stderr)."""
    for line in proc.stdout:
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        print(line, end="", file=sys.stderr)
    raise RuntimeError(f"the {what} child exited (code {proc.wait()}) without its line; see its stderr above")


def _child(kind: str, model_dir: Path, device: str, prompt: list[int]) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--model-dir", str(model_dir),
           "--device", device, "--prompt", ",".join(map(str, prompt))]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def time_thaw(model_dir: Path, device: str, prompt: list[int], drop_cache: bool) -> dict:
    proc = _child("thaw", model_dir, device, prompt)
    watchdog = threading.Timer(CHILD_TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        ready = _read_json(proc, "thaw")
        how_dropped = drop_page_cache(model_dir) if drop_cache else None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = _read_json(proc, "thaw")
        proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
    return {**result, "warm_up_s": ready["warm_up_s"], "page_cache_drop": how_dropped}


def time_hf(model_dir: Path, device: str, prompt: list[int]) -> dict:
    spawned = time.monotonic()
    proc = _child("hf", model_dir, device, prompt)
    watchdog = threading.Timer(CHILD_TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        stamps = _read_json(proc, "hf")
        proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
    return {"from_process_start_s": stamps["first_token_at"] - spawned,
            "after_imports_s": stamps["first_token_at"] - stamps["imported_at"],
            "load_s": stamps["loaded_at"] - stamps["cuda_ready_at"], "token": stamps["token"]}


def run(mode: ColdstartMode, device: str, work_dir: Path, shm_dir: Path | None) -> list[dict]:
    from loader import convert_checkpoint
    from worker import DemoModelConfig, write_demo_model

    hf_dir = write_demo_model(work_dir / "hf", DemoModelConfig(**mode.model_kwargs))
    ssd_dir = work_dir / "thaw"
    convert_checkpoint(hf_dir, ssd_dir, progress=False)
    model_bytes = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    dirs = {"thaw-ssd": ssd_dir}
    if shm_dir is not None:
        dirs["thaw-dram"] = Path(shutil.copytree(ssd_dir, shm_dir / "thaw"))
    _log(f"model: {model_bytes / 1e9:.2f} GB bf16; thaw checkpoint on {fs_type(ssd_dir)} at {ssd_dir}"
         + (f" and on {fs_type(dirs['thaw-dram'])} at {dirs['thaw-dram']}" if shm_dir is not None else ""))
    prompt = [3 + (i * 7919) % 997 for i in range(mode.prompt_tokens)]  # fixed ids in the tokenizer's range

    tries: dict[str, list[dict]] = {case: [] for case in [*dirs, "hf-replica"]}
    errors: dict[str, list[str]] = {case: [] for case in tries}
    for attempt in range(mode.repeats + 1):  # round 0 is untimed: it fills the caches a served node has
        for case in tries:
            try:
                if case == "hf-replica":
                    read_into_page_cache(hf_dir)  # an SSD case's drop_caches dropped it too
                    result = time_hf(hf_dir, device, prompt)
                else:
                    result = time_thaw(dirs[case], device, prompt, drop_cache=case == "thaw-ssd")
            except Exception as exc:  # noqa: BLE001 - one failed try is reported, the others go on
                errors[case].append(f"{type(exc).__name__}: {str(exc)[:300]}")
                _log(f"{case} try {attempt} failed: {errors[case][-1]}")
                continue
            _log(f"{'warm-up' if attempt == 0 else f'try {attempt}'} {case}: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in result.items() if isinstance(v, float)))
            if attempt:
                tries[case].append(result)
    common = {"bench": BENCH, "mode": mode.name, "device": _device_label(device), "model_bytes": model_bytes,
              "prompt_tokens": mode.prompt_tokens, "baseline": BASELINE}
    return case_lines(common, tries, errors, {case: fs_type(path) for case, path in dirs.items()})


def case_lines(common: dict, tries: dict[str, list[dict]], errors: dict[str, list[str]], fs: dict[str, str]
               ) -> list[dict]:
    """One line per case: medians, every try, ratios to the baseline and the targets."""
    hf_tries = tries.pop("hf-replica")
    baseline_s = statistics.median(t["from_process_start_s"] for t in hf_tries) if hf_tries else None
    after_imports_s = statistics.median(t["after_imports_s"] for t in hf_tries) if hf_tries else None
    common = {**common, "baseline_s": None if baseline_s is None else round(baseline_s, 4)}
    lines = []
    for case, case_tries in tries.items():
        if not case_tries:
            lines.append({**common, "case": case, "skipped": f"every try failed: {errors[case][:1]}"})
            continue
        median_s = statistics.median(t["first_token_s"] for t in case_tries)
        ratio = None if baseline_s is None else baseline_s / median_s
        met = None if ratio is None else ratio >= TARGETS[case]
        line = {**common, "case": case, "ttft_s": round(median_s, 4),
                "ttft_all_s": [round(t["first_token_s"], 4) for t in case_tries],
                "load_s": [round(t["load_s"], 4) for t in case_tries], "load_report": case_tries[-1]["load_report"],
                "spare_warm_up_s": round(statistics.median(t["warm_up_s"] for t in case_tries), 3), "fs": fs[case],
                "ratio_to_baseline": None if ratio is None else round(ratio, 2),
                "ratio_to_baseline_after_imports": None if ratio is None else round(after_imports_s / median_s, 2),
                "target_ratio": TARGETS[case], "target_met": met, "errors": errors[case],
                "first_tokens": [t["token"] for t in case_tries], "baseline_first_tokens": [t["token"] for t in hf_tries]}
        if case == "thaw-ssd":
            line["page_cache_drop"] = case_tries[-1]["page_cache_drop"]
        line["summary"] = {"case": case, "ours": f"{median_s:.3f} s",
                           "peer": "—" if baseline_s is None else f"{baseline_s:.3f} s (HF replica path)",
                           "ratio": None if ratio is None else round(ratio, 2), "target_met": met}
        lines.append(line)
    if not hf_tries:
        lines.append({**common, "case": BASELINE, "skipped": f"every try failed: {errors['hf-replica'][:1]}"})
        return lines
    for case, key in ((BASELINE, "from_process_start_s"), ("hf-replica-after-imports", "after_imports_s")):
        median_s = statistics.median(t[key] for t in hf_tries)
        lines.append({**common, "case": case, "ttft_s": round(median_s, 4),
                      "ttft_all_s": [round(t[key], 4) for t in hf_tries],
                      "load_s": [round(t["load_s"], 4) for t in hf_tries],
                      "ratio_to_baseline": round(baseline_s / median_s, 2), "errors": errors["hf-replica"]})
    return lines


def memory_backed_dir(min_free_bytes: int) -> tuple[Path | None, str]:
    """A writable tmpfs directory with room (/dev/shm first; a container's may be tiny), or None
    and what was tried."""
    tried = []
    for candidate in (SHM_DIR, Path("/run/shm"), Path(tempfile.gettempdir()), Path("/run")):
        if not candidate.is_dir():
            continue
        kind, free = fs_type(candidate), shutil.disk_usage(candidate).free
        tried.append(f"{candidate}: {kind}, {free / 1e9:.2f} GB free")
        if kind in MEMORY_FS_TYPES and free >= min_free_bytes and os.access(candidate, os.W_OK):
            return candidate, "; ".join(tried)
    return None, "; ".join(tried)


def _device_label(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, one try per case")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timed tries per case (default 3, quick 1)")
    parser.add_argument("--work-dir", type=Path, default=None, help="a directory on a disk (default: temp dir)")
    parser.add_argument("--child", choices=["thaw", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        prompt = [int(t) for t in args.prompt.split(",")]
        (child_thaw if args.child == "thaw" else child_hf)(args.model_dir, args.device, prompt)
        return 0
    mode = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be >= 1")
        mode = dataclasses.replace(mode, repeats=args.repeats)
    missing = cuda_missing_reason(args.device)
    if missing is not None:
        emit({"bench": BENCH, "mode": mode.name, "skipped": missing})
        return 0
    emit({"bench": BENCH, "mode": mode.name, "peer": "ray-serve", "skipped": RAY_SERVE_NOT_RUN})
    need_bytes = 3 * (5 << 20 if args.quick else 2_100_000_000) + (1 << 30)  # HF + thaw copies, with room
    work_dir = Path(tempfile.mkdtemp(prefix="thaw-coldstart-gpu-", dir=disk_work_dir(args.work_dir, need_bytes)))
    shm_dir = None
    try:
        memory_dir, tried = memory_backed_dir(need_bytes // 3 + (256 << 20))
        if memory_dir is not None:
            shm_dir = Path(tempfile.mkdtemp(prefix="thaw-coldstart-gpu-", dir=memory_dir))
        else:
            emit({"bench": BENCH, "mode": mode.name, "case": "thaw-dram",
                  "skipped": f"no tmpfs with room for the model (tried {tried}); the DRAM tier needs one"})
        for line in run(mode, args.device, work_dir, shm_dir):
            emit(line)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
