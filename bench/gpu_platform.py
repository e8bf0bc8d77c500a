"""The platform on a GPU (issue 38): five models on one GPU whose budget holds only some, driven
through the HTTP API, to the 8B model's first token asleep, from the DRAM tier and in a fresh host.

It writes a Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 query / 8 KV heads, MLP 14336,
vocab 128256: 8.03B parameters, 16.1 GB) and four Llama-3.2-1B-shaped ones (hidden 2048, 16
layers, 32 / 8 heads, MLP 8192, vocab 128256, tied embeddings: 1.24B, 2.5 GB each), random bf16
weights (`bench.random_llama`), into a local repository under ``--model-dir`` (default
/dev/shm/thaw-gpu-platform, kept: a rerun writes nothing). It starts the real platform, ``python -m
infra.cli serve`` (``thaw serve``: a local Ray of its own, no auth, a free port, its output in
``serve.log``) with ``--models-per-process 5 --gpu-memory-gb G``: the GPU's slot host holds up to
five models within G (`plan_budget`: an instance takes its checkpoint's bytes plus its KV pool, the
spec's ``kv_cache_bytes``; G holds the 8B and two 1Bs, not three). State and SSD tier on a disk,
repository and DRAM tier in tmpfs. Each model is deployed from the repository (``source:
<repository>/<name>``, no copy) with ``num_gpus 1``, 0..1 instances, no up/downscale delay; the 8B's
keep-alive is short (8 s: it sleeps between tries, yet outlasts the node's 5 s settling after its
cold start, when the controller copies it into DRAM), the 1Bs' long (the 8B is the one sleeper).
Then one request at a time, each streamed through the ``openai`` client (a 128-token prompt of
token ids, greedy, ``max_tokens 2``, ``logprobs 0`` so every token is an event), timed from the call
to the first chunk:

1. ``cold-fresh-host``: the 8B's first request. The host process is warm (started with the node:
   torch imported, CUDA context made) but never held a model: the time includes fetching the
   checkpoint from the repository into the node's SSD tier, the load to the GPU, the first kernels
   of these shapes and the prefill. Once a run (a host is fresh once). Then the wait, polling the
   status, for its copy in the DRAM tier;
2. each 1B in turn (the budget holds two beside a resident 8B), then the 8B once more (``setup``:
   resident again, so its wakes find room);
3. ``asleep`` (``--repeats``, default 3): once the status shows the 8B asleep (weights in pinned host memory,
   KV pool freed), a request; it counts as a wake only if the same instance answered and the
   status's wake counter moved;
4. ``dram`` (``--repeats``): with the 8B asleep, the 1Bs asked in turn until the status shows its
   sleeper stopped (sleepers are evicted first) or every 1B is resident; then
   a request: it counts only if a new instance answered, placed on (or loaded from) the DRAM tier
   into the warm host. The try says whether the sleeper was stopped before it and the evictions
   during it: on a GPU a sleeper holds no device memory but keeps its place in the host, so with
   five places the 1Bs all fit beside it, and the request itself stops it (no room to wake) and
   evicts two idle 1Bs for its memory. The instance's own load (``load_s``) is reported apart.

One JSON line on stdout, progress on stderr: min / median / every try per case, the targets
(asleep <= 0.35 s, DRAM tier <= 0.6 s, on an H100/H200) and our ratio to each, ServerlessLLM's
reported 0.678 s for Llama-3.1-8B's load alone on an H100 (text only: their paper's figure, not
measured here) with the ratios of our DRAM first token and of our DRAM load alone to it, requests
and failures, sleeps / wakes / evictions from the status, the budget and its arithmetic, the hosts
at the end, the device, and ``checks`` (every request succeeded; a sleep, a wake and an eviction
seen; each try of its case's kind; memory within the budget the status reports). Exit 1 if a
request failed or a check did not hold; without CUDA one skipped line, exit 0. Past
``--time-limit-s`` (default 450) the sequence stops where it is and the line reports what was
measured, so a runner's timeout never loses it all.

``--quick``: the same sequence (2 tries a case) with tiny models, on the CPU unless ``--device
cuda``; on the CPU the budget is the node's worker memory (``--worker-memory-gb``, a worker slot
per model) and the specs ask ``num_gpus 0``. It runs the whole path -- real Ray, the platform, the
openai client -- without a GPU; targets are judged only for the full shapes.
``--dry-run``: the plan, the commands and the budget arithmetic for the GPU shapes (from the
weights' bytes; a run uses the repository's exact ones); writes and starts nothing.

    python bench/gpu_platform.py [--quick] [--device cuda|cpu] [--model-dir DIR] [--state-dir DIR]
                                 [--serve-log FILE] [--repeats N] [--time-limit-s S] [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.coldstart import free_port, wait_for  # noqa: E402
from bench.gpu_common import MEMORY_FS_TYPES, cuda_missing_reason, disk_work_dir, emit, fs_type, log  # noqa: E402
from bench.gpu_platform_alternation import Alternation  # noqa: E402
from bench.gpu_platform_setup import (ASLEEP, BENCH, COLD, DRAM, FULL, NUM_SMALL_BESIDE_BIG, QUICK,  # noqa: E402
                                      REQUEST_DEADLINE_S, SMALL, PlatformMode)
from bench.random_llama import is_published, num_weight_bytes, publish_random_llama  # noqa: E402
from bench.served_platform import ServedPlatform  # noqa: E402

GIB = 1 << 30
TARGET_ASLEEP_S = 0.35
TARGET_DRAM_S = 0.6
SERVERLESSLLM_LOAD_S = 0.678  # Llama-3.1-8B's load alone on an H100, as ServerlessLLM reports it
SERVERLESSLLM_PEER = ("ServerlessLLM: 0.678 s for Llama-3.1-8B's load alone on an H100 (reported, not "
                      "measured here; a load, not a request's first token)")
TENANT = "bench"
MODELS_PER_PROCESS = 5
SHM_DIR = Path("/dev/shm")  # where node stores keep their DRAM tier (storage.NodeStoreConfig.shm_root)
DEFAULT_MODEL_DIR = SHM_DIR / "thaw-gpu-platform"
START_TIMEOUT_S = 300.0
DEFAULT_TIME_LIMIT_S = 450.0  # a lent GPU machine's run: one call of at most 600 s


# ---- the budget (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetPlan:
    """The device (or, on CPU, worker) memory budget the hosted models share, and why."""

    big_instance_bytes: int  # the 8B's checkpoint bytes + its KV pool
    small_instance_bytes: int  # one 1B's
    num_small: int
    budget_bytes: int

    def fits(self, num_big: int, num_small: int) -> bool:
        return num_big * self.big_instance_bytes + num_small * self.small_instance_bytes <= self.budget_bytes

    @property
    def num_small_beside_big(self) -> int:
        """How many 1Bs fit beside a resident 8B."""
        return max(0, (self.budget_bytes - self.big_instance_bytes) // self.small_instance_bytes)

    @property
    def budget_gb(self) -> str:
        """The budget as the ``--*-memory-gb`` flags take it (GiB), exact to well under a kB."""
        return f"{self.budget_bytes / GIB:.9f}"

    def lines(self) -> list[str]:
        big, small, n = self.big_instance_bytes, self.small_instance_bytes, self.num_small
        k = self.num_small_beside_big
        return [f"8B instance: {big:,} B; 1B instance: {small:,} B (checkpoint + KV pool each)",
                f"budget {self.budget_bytes:,} B = {self.budget_gb} GiB",
                f"8B + {k} x 1B = {big + k * small:,} B fits; 8B + {k + 1} x 1B = {big + (k + 1) * small:,} B "
                f"does not; all five = {big + n * small:,} B do not"]


def plan_budget(big_weight_bytes: int, small_weight_bytes: int, kv_cache_bytes: int, num_small: int,
                num_small_beside_big: int = NUM_SMALL_BESIDE_BIG) -> BudgetPlan:
    """A budget that holds the big model and `num_small_beside_big` small ones with half a small
    one to spare, so rounding cannot move the line: one more small one does not fit."""
    if num_small <= num_small_beside_big:
        raise ValueError(f"with {num_small} small models beside room for {num_small_beside_big}, all would fit")
    big, small = big_weight_bytes + kv_cache_bytes, small_weight_bytes + kv_cache_bytes
    return BudgetPlan(big, small, num_small, big + num_small_beside_big * small + small // 2)


# ---- the result line (pure) ---------------------------------------------------------------------


def _figures(name: str, values: list[float]) -> dict[str, Any]:
    if not values:
        return {f"{name}_s": None, f"{name}_min_s": None, f"{name}_all_s": []}
    return {f"{name}_s": round(statistics.median(values), 4), f"{name}_min_s": round(min(values), 4),
            f"{name}_all_s": [round(v, 4) for v in values]}


def _ratio(ours: float | None, theirs: float) -> float | None:
    return None if ours is None else round(ours / theirs, 3)


def result_line(mode: str, device: str, plan: BudgetPlan, tries: list[dict[str, Any]], counts: dict[str, int],
                checks: dict[str, bool], on_gpu: bool) -> dict[str, Any]:
    """The run's JSON line from its tries (each with ``phase``, ``ttft_s``, ``failure``), the
    status's counter deltas and the sequence checks; targets judged only `on_gpu`."""
    def ttfts(phase: str, key: str = "ttft_s") -> list[float]:
        return [t[key] for t in tries if t["phase"] == phase and t["failure"] is None and t.get(key) is not None]

    failures: dict[str, int] = {}
    for t in tries:
        if t["failure"] is not None:
            failures[t["failure"]] = failures.get(t["failure"], 0) + 1
    line: dict[str, Any] = {"bench": BENCH, "mode": mode, "device": device,
                            **_figures("asleep_ttft", ttfts(ASLEEP)), **_figures("dram_ttft", ttfts(DRAM)),
                            **_figures("cold_fresh_host_ttft", ttfts(COLD)),
                            **_figures("small_ttft", ttfts(SMALL)),
                            # the worker's own load of a new instance: comparable with a peer's load alone
                            **_figures("dram_load", ttfts(DRAM, "load_s")),
                            **_figures("cold_fresh_host_load", ttfts(COLD, "load_s"))}
    asleep, dram = line["asleep_ttft_s"], line["dram_ttft_s"]
    line.update({
        "target_asleep_s": TARGET_ASLEEP_S, "target_dram_s": TARGET_DRAM_S,
        "ratio_asleep_to_target": _ratio(asleep, TARGET_ASLEEP_S), "ratio_dram_to_target": _ratio(dram, TARGET_DRAM_S),
        "peer": SERVERLESSLLM_PEER, "peer_dram_load_s": SERVERLESSLLM_LOAD_S,
        "ratio_dram_to_peer": _ratio(dram, SERVERLESSLLM_LOAD_S),
        "ratio_dram_load_to_peer": _ratio(line["dram_load_s"], SERVERLESSLLM_LOAD_S),
        "num_requests": len(tries), "num_failed": sum(failures.values()), "failures": failures,
        "sleeps": counts.get("sleeps", 0), "wakes": counts.get("wakes", 0), "evictions": counts.get("evictions", 0),
        "budget_bytes": plan.budget_bytes, "budget_gb": plan.budget_gb,
        "big_instance_bytes": plan.big_instance_bytes, "small_instance_bytes": plan.small_instance_bytes,
        "num_small_beside_big": plan.num_small_beside_big, "checks": checks,
    })
    met = None
    if on_gpu:
        met = (asleep is not None and asleep <= TARGET_ASLEEP_S and dram is not None and dram <= TARGET_DRAM_S
               and all(checks.values()))
    line["targets_met"] = met
    shown = " / ".join("—" if v is None else f"{v:.3f} s" for v in (asleep, dram, line["cold_fresh_host_ttft_s"]))
    line["summary"] = {"case": "8B first token: asleep / DRAM tier / cold in a fresh host", "ours": shown,
                       "peer": f"targets {TARGET_ASLEEP_S} / {TARGET_DRAM_S} s; ServerlessLLM load "
                               f"{SERVERLESSLLM_LOAD_S} s (reported)",
                       "ratio": line["ratio_dram_to_peer"], "target_met": met}
    return line


def sequence_checks(tries: list[dict[str, Any]], counts: dict[str, int], repeats: int) -> dict[str, bool]:
    """Whether the run showed what it must: every request answered, a sleep, a wake and an
    eviction, and each case's tries of the right kind (a wake; a new instance from DRAM)."""
    of = {phase: [t for t in tries if t["phase"] == phase] for phase in (COLD, ASLEEP, DRAM)}
    return {"every_request_succeeded": all(t["failure"] is None for t in tries),
            "slept_woke_evicted": counts.get("sleeps", 0) > 0 and counts.get("wakes", 0) > 0
                                  and counts.get("evictions", 0) > 0,
            "cold_try_in_a_fresh_host": len(of[COLD]) == 1 and of[COLD][0].get("host_was_empty") is True,
            "asleep_tries_were_wakes": len(of[ASLEEP]) == repeats and all(t.get("woke") for t in of[ASLEEP]),
            "dram_tries_loaded_from_dram": len(of[DRAM]) == repeats and all(
                t.get("new_instance") and "dram" in (t.get("placed_tier"), t.get("tier")) for t in of[DRAM])}


# ---- the platform's command and the models' specs -----------------------------------------------


def serve_command(on_gpu: bool, plan: BudgetPlan, port: int, state_dir: Path, repository: Path, ssd_gb: float,
                  dram_gb: float, namespace: str) -> list[str]:
    """The ``thaw serve`` command: one slot host per GPU holding up to five models within the
    budget (on CPU: one node whose worker memory is the budget, a slot per model)."""
    memory = (["--gpu-memory-gb", plan.budget_gb] if on_gpu else
              ["--worker-memory-gb", plan.budget_gb, "--worker-slots", str(1 + plan.num_small), "--num-cpus", "2"])
    return [sys.executable, "-m", "infra.cli", "serve", "--no-auth", "--port", str(port), "--namespace", namespace,
            "--state", str(state_dir), "--repository", str(repository), "--ssd-capacity-gb", f"{ssd_gb:g}",
            "--dram-capacity-gb", f"{dram_gb:g}", "--no-calibrate", "--models-per-process", str(MODELS_PER_PROCESS),
            *memory]


def model_spec(name: str, repository: Path, mode: PlatformMode, on_gpu: bool, keep_alive_s: float) -> dict[str, Any]:
    return {"tenant": TENANT, "name": name, "source": f"{repository}/{name}", "kv_cache_bytes": mode.kv_cache_bytes,
            "resources": {"num_cpus": 1, "num_gpus": 1 if on_gpu else 0},
            "autoscaling": {"min_instances": 0, "max_instances": 1, "keep_alive_s": keep_alive_s,
                            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "queue_timeout_s": REQUEST_DEADLINE_S}}


# ---- the run ------------------------------------------------------------------------------------


def model_names(mode: PlatformMode) -> tuple[str, list[str]]:
    prefix = "" if mode.judged else f"{mode.name}-"
    return f"{prefix}llama3-8b", [f"{prefix}llama32-1b-{i}" for i in range(mode.num_small)]


def device_name(on_gpu: bool) -> str:
    if not on_gpu:
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "cuda (nvidia-smi said nothing)"
    except (OSError, subprocess.TimeoutExpired):
        return "cuda (no nvidia-smi)"


def tier_sizes_gb(total_model_bytes: int) -> float:
    """SSD and DRAM tier capacities that hold every model with room to spare."""
    return float(-(-int(total_model_bytes * 1.1) // GIB) + 1)


def check_room(path: Path, need_bytes: int, what: str) -> None:
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ValueError(f"{what} needs {need_bytes / 1e9:.1f} GB free at {path} ({fs_type(path)}), "
                         f"has {free / 1e9:.1f} GB; free some or pass another directory")


def tier_capacity_gb(path: Path, wanted_gb: float, big_bytes: int, what: str) -> float:
    """`wanted_gb`, or what `path` has free less 2 GiB where that is less, as long as the tier
    still holds the big model (it is the one measured from it); else ValueError."""
    free_gb = shutil.disk_usage(path).free / GIB - 2.0
    capacity_gb = min(wanted_gb, float(int(free_gb)))
    check_room(path, int(big_bytes * 1.1) + 2 * GIB, what)
    if capacity_gb < wanted_gb:
        log(BENCH, f"{what}: {capacity_gb:g} GiB (what {path} has free), not {wanted_gb:g}: least recently used "
                   f"copies of the 1Bs may be evicted from it")
    return capacity_gb


def run(mode: PlatformMode, on_gpu: bool, model_dir: Path, state_dir: Path, serve_log: Path, deadline: float
        ) -> tuple[dict[str, Any], bool]:
    repository = model_dir.absolute() / "repository"
    big_name, small_names = model_names(mode)
    started = time.monotonic()
    models = [(big_name, mode.big)] + [(n, dataclasses.replace(mode.small, seed=1 + i))
                                       for i, n in enumerate(small_names)]
    missing = [num_weight_bytes(config) for name, config in models if not is_published(repository, name)]
    if missing:  # each is written, converted next to it, then copied in: twice the largest at once
        check_room(model_dir, sum(missing) + max(missing), "writing the checkpoints")
    sizes = {}
    for name, config in models:
        sizes[name], reused = publish_random_llama(repository, name, config)
        log(BENCH, f"{name}: {sizes[name] / 1e9:.3f} GB in {repository} ({'reused' if reused else 'written'})")
    write_s = time.monotonic() - started
    plan = plan_budget(sizes[big_name], max(sizes[n] for n in small_names), mode.kv_cache_bytes, mode.num_small)
    for line in plan.lines():
        log(BENCH, line)
    ssd_gb = dram_gb = tier_sizes_gb(sum(sizes.values()))
    if on_gpu:
        ssd_gb = tier_capacity_gb(state_dir, ssd_gb, sizes[big_name], "the SSD tier")
        dram_gb = tier_capacity_gb(SHM_DIR, dram_gb, sizes[big_name], "the DRAM tier")
    port = free_port()
    platform = ServedPlatform(serve_command(on_gpu, plan, port, state_dir / "state", repository, ssd_gb, dram_gb,
                                            f"gpuplatform{uuid.uuid4().hex[:8]}"),
                              f"http://127.0.0.1:{port}", serve_log, REQUEST_DEADLINE_S)
    log(BENCH, f"starting: {shlex.join(platform.command)} (log: {platform.log_path})")
    error, alternation, start_s = None, None, None
    try:
        platform.start(max(1.0, min(START_TIMEOUT_S, deadline - time.monotonic())))
        for name in [big_name, *small_names]:
            keep_alive_s = mode.big_keep_alive_s if name == big_name else mode.small_keep_alive_s
            platform.deploy(model_spec(name, repository, mode, on_gpu, keep_alive_s))
        try:
            wait_for(lambda: any(h.get("warm") for h in platform.status().get("hosts", [])), "a warm slot host",
                     max(1.0, min(START_TIMEOUT_S, deadline - time.monotonic())), 0.5)
        except TimeoutError as exc:
            log(BENCH, f"going on without: {exc}")
        start_s = time.monotonic() - started - write_s
        alternation = Alternation(platform, mode, f"{TENANT}/{big_name}", [f"{TENANT}/{n}" for n in small_names],
                                  deadline)
        alternation.run()
    except Exception as exc:  # noqa: BLE001 - the line still carries what was measured, and why it stopped
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
        log(BENCH, f"stopped early: {error}; the platform's log ends:\n{platform.log_tail()}")
    final: dict[str, Any] = {}
    try:
        final = alternation.status() if alternation is not None else {}
    except Exception as exc:  # noqa: BLE001 - a platform that died: the line says so
        error = error or f"the last status: {type(exc).__name__}: {exc}"
    finally:
        platform.stop()
    tries = alternation.tries if alternation is not None else []
    counts = alternation.counts_delta(final) if alternation is not None and final else {}
    budgets = {k: v for n in final.get("nodes", []) for k, v in n.items()
               if isinstance(v, dict) and "budget_bytes" in v}
    max_used = alternation.max_used if alternation is not None else {}
    checks = sequence_checks(tries, counts, mode.repeats)
    if budgets:  # where the status reports a node's budget, the memory sampled in use stayed within it
        checks["memory_within_budget"] = all(max_used.get(k, 0) <= v["budget_bytes"] for k, v in budgets.items())
    line = result_line(mode.name, device_name(on_gpu), plan, tries, counts, checks, on_gpu and mode.judged)
    line.update({"error": error, "model_bytes": sizes, "budget_arithmetic": plan.lines(),
                 "platform_budgets": {k: v["budget_bytes"] for k, v in budgets.items()}, "max_used_bytes": max_used,
                 "hosts_at_end": [{"actor_name": h.get("actor_name"), "warm": h.get("warm"),
                                   "memory_bytes": h.get("memory_bytes"),
                                   "instances": [[i["model_id"], i["state"], i["memory_bytes"]]
                                                 for i in h.get("instances", [])]} for h in final.get("hosts", [])],
                 "tries": tries, "write_s": round(write_s, 1),
                 "platform_start_s": None if start_s is None else round(start_s, 1),
                 "total_s": round(time.monotonic() - started, 1), "serve_command": shlex.join(platform.command[1:])})
    return line, error is None and all(checks.values())


def dry_run(mode: PlatformMode, on_gpu: bool, model_dir: Path) -> None:
    """The plan for `mode` without writing or starting anything."""
    big_name, small_names = model_names(mode)
    big_bytes, small_bytes = num_weight_bytes(mode.big), num_weight_bytes(mode.small)
    plan = plan_budget(big_bytes, small_bytes, mode.kv_cache_bytes, mode.num_small)
    repository = model_dir.absolute() / "repository"
    total = big_bytes + mode.num_small * small_bytes
    print(f"models (random {mode.big.dtype}, in {repository}; weights' bytes, the run uses the repository's):")
    print(f"  {big_name}: {big_bytes:,} B; {', '.join(small_names)}: {small_bytes:,} B each; "
          f"total {total / 1e9:.2f} GB")
    print("budget (the weights' bytes; the run's adds the few MB of tokenizer and config):")
    for line in plan.lines():
        print("  " + line)
    tiers_gb = tier_sizes_gb(total)
    print(f"room: {total / 1e9:.1f} GB for the repository in {model_dir} (plus the model being written, once), "
          f"{tiers_gb:g} GiB DRAM tier in /dev/shm, {tiers_gb:g} GiB SSD tier in the state dir")
    command = serve_command(on_gpu, plan, 0, Path("<state>") / "state", repository, tiers_gb, tiers_gb, "<namespace>")
    print("platform: " + shlex.join(command[1:]).replace("--port 0", "--port <free port>"))
    for name in [big_name, *small_names]:
        keep_alive_s = mode.big_keep_alive_s if name == big_name else mode.small_keep_alive_s
        print(f"deploy: {json.dumps(model_spec(name, repository, mode, on_gpu, keep_alive_s))}")
    print(f"sequence: {COLD} x1 ({big_name}'s first request), {SMALL} x{mode.num_small} (each 1B once), "
          f"{ASLEEP} x{mode.repeats} (after the status shows it asleep), {DRAM} x{mode.repeats} (after 1Bs asked in "
          f"turn until its sleeper is stopped); prompt {mode.prompt_tokens} tokens, max_tokens {mode.max_tokens}")
    print(f"targets (GPU): asleep <= {TARGET_ASLEEP_S} s, DRAM tier <= {TARGET_DRAM_S} s; peer: {SERVERLESSLLM_PEER}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (default device: cpu), the same sequence")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda, quick: cpu")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help=f"where the repository of checkpoints goes, kept for reruns (default: "
                             f"{DEFAULT_MODEL_DIR}; quick: a temp dir, removed)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="the platform's state and SSD tier, on a disk (default: a temp dir there, removed)")
    parser.add_argument("--serve-log", type=Path, default=None,
                        help="where thaw serve's own output goes (default: serve.log in the state dir)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="tries of the asleep and DRAM cases (default 3, quick 2)")
    parser.add_argument("--time-limit-s", type=float, default=DEFAULT_TIME_LIMIT_S,
                        help="the sequence stops here and reports what it measured (default %(default)g; the "
                             "platform's stop comes after it)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the budget; write nothing")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.time_limit_s
    mode = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be >= 1")
        mode = dataclasses.replace(mode, repeats=args.repeats)
    on_gpu = (args.device or ("cpu" if args.quick else "cuda")) == "cuda"
    if not on_gpu and mode.judged:
        parser.error("the full shapes need a GPU (an 8B model on CPU cores); use --quick on a CPU")
    if args.dry_run:
        dry_run(mode, on_gpu, args.model_dir or DEFAULT_MODEL_DIR)
        return 0
    if on_gpu and cuda_missing_reason("cuda") is not None:
        emit({"bench": BENCH, "mode": mode.name, "skipped": "no CUDA device: the platform's GPU run needs one "
                                                             "(--quick runs the same sequence on the CPU)"})
        return 0
    keep_models = args.model_dir is not None or mode.judged
    model_dir = args.model_dir or (DEFAULT_MODEL_DIR if mode.judged
                                   else Path(tempfile.mkdtemp(prefix="thaw-gpu-platform-")))
    model_dir.mkdir(parents=True, exist_ok=True)
    if on_gpu and fs_type(model_dir) not in MEMORY_FS_TYPES:
        log(BENCH, f"{model_dir} is on {fs_type(model_dir)}, not tmpfs: the cold start reads the repository from it")
    need = int(tier_sizes_gb(num_weight_bytes(mode.big) + mode.num_small * num_weight_bytes(mode.small)) * GIB)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="thaw-gpu-platform-state-",
                                                        dir=disk_work_dir(None, need) if on_gpu else None))
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        line, ok = run(mode, on_gpu, model_dir, state_dir, args.serve_log or state_dir / "serve.log", deadline)
    finally:
        if args.state_dir is None:
            shutil.rmtree(state_dir, ignore_errors=True)
        if not keep_models:
            shutil.rmtree(model_dir, ignore_errors=True)
    emit(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
