"""Loading a checkpoint into GPU memory: Thaw's `DeviceLoader` against safetensors,
runai-model-streamer and fastsafetensors, from the DRAM tier and from a cold disk.

One run writes a random Llama-shaped bf16 model (hidden 2560, 20 layers, vocabulary 32000:
~3.1 GB; ``--quick`` ~150 MB) as ``model.safetensors`` and converts it to the thaw format, both
on a disk-backed directory, and copies both into /dev/shm (the node's DRAM tier is tmpfs). Each
measurement is the wall time from the call until every tensor is in GPU memory
(``torch.cuda.synchronize()`` included), in one process whose CUDA context is already up (a warm
worker's), after one untimed round that loads everything once (library start-up, the loader's
verification record). Rounds interleave every (source, loader) pair, so drift in the disk's rate
hits every loader alike; a line gives the median and every run's figure.

Sources: ``dram`` (the files in /dev/shm) and ``disk`` (the disk copy, pushed out of the page
cache before every run: ``echo 1 > /proc/sys/vm/drop_caches`` as root, else POSIX_FADV_DONTNEED per
file; ``eviction`` says which ran and ``cached_fraction_after_evict`` whether it worked).

Loaders:
* ``thaw-registered``: ours from the DRAM tier, DMA straight from the tier's pages registered with
  ``cudaHostRegister`` (opt-in: measured 5x slower than staging on an H100); run on dram only.
* ``thaw-staged``: ours through the pinned staging pool (``--threads`` readers, ``--buffers`` x
  ``--buffer-mib``, allocated before the clock starts as a warm worker keeps it).
* ``thaw-read-to-pinned``: ours with the device copy left out -- the source's own bandwidth into
  pinned memory (O_DIRECT from disk; a kernel copy from tmpfs).
* ``h2d-pinned``: ``copy_(non_blocking=True)`` of a pinned buffer, the link's bandwidth.
* peers: ``safetensors-load_file`` (``load_file(device="cuda:0")``), ``safetensors-safe_open``
  (``safe_open(device="cuda:0")``, every ``get_tensor``), ``runai-model-streamer``
  (``SafetensorsStreamer.stream_file``, each tensor ``.to("cuda:0")``), ``fastsafetensors``
  (``SafeTensorsFileLoader(nogds=True).copy_files_to_device()``). A peer that is not installed or
  fails to start prints a line saying why.

Our line per source (``thaw-staged``, the default of `load_model` on both) carries the targets of
issue 26: ``limit_gbps`` = min(source, link), ``fraction_of_limit`` >= 0.8, and faster than each
peer measured (``ratio_thaw_to_peer``); every peer line carries ``ratio_thaw_to_this``.

    python bench/loader_gpu.py [--quick] [--repeats 3] [--threads 8] [--buffers 16] [--buffer-mib 16]
                               [--work-dir DIR] [--budget-s 200]

One JSON line per (source, loader) on stdout, progress on stderr. Without a CUDA device one line
saying so, exit 0. Full mode is meant to finish within ~4 minutes on one H100 box (``--budget-s``
stops starting new rounds once the next would pass it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import disk_work_dir, drop_page_cache, emit, fs_type, log  # noqa: E402

BENCH = "loader_gpu"
PEERS = ("safetensors-load_file", "safetensors-safe_open", "runai-model-streamer", "fastsafetensors")
PEER_MODULES = {"safetensors-load_file": "safetensors.torch", "safetensors-safe_open": "safetensors",
                "runai-model-streamer": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}
PEER_PACKAGES = {"safetensors-load_file": "safetensors", "safetensors-safe_open": "safetensors",
                 "runai-model-streamer": "runai-model-streamer", "fastsafetensors": "fastsafetensors"}
OURS_DEFAULT = {"dram": "thaw-staged", "disk": "thaw-staged"}  # what the platform's load_model takes
RAW = "thaw-read-to-pinned"
TARGET_FRACTION = 0.8


# ---- the model ----------------------------------------------------------------------------------

def model_shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    hidden, inter, layers, vocab = (1024, 2816, 4, 16000) if quick else (2560, 6912, 20, 32000)
    kv = hidden // 4
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def write_model(work_dir: Path, quick: bool) -> tuple[Path, Path]:
    """model.safetensors (random bf16) and its thaw conversion under `work_dir`."""
    import torch
    from safetensors.torch import save_file

    from loader import convert_checkpoint

    hf_dir, thaw_dir = work_dir / "hf", work_dir / "thaw"
    hf_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(1 << 24, generator=gen).to(torch.bfloat16)  # [16M]: tiled, shifted per tensor
    tensors = {}
    for i, (name, shape) in enumerate(model_shapes(quick).items()):
        numel = math.prod(shape)
        shift = (i * 7919) % block.numel()
        tiled = torch.cat([block[shift:], block[:shift]]).repeat(-(-numel // block.numel()))
        tensors[name] = tiled[:numel].view(shape).clone()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    del tensors
    convert_checkpoint(hf_dir, thaw_dir, progress=False)
    return hf_dir / "model.safetensors", thaw_dir


def cached_fraction(files: list[Path]) -> float:
    """Share of the files' bytes the page cache holds (mincore; no I/O)."""
    from loader.page_cache import resident_runs, residency_supported

    if not residency_supported():
        return -1.0
    cached = total = 0
    for path in files:
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            cached += sum(end - start for start, end in resident_runs(fd, 0, size))
        finally:
            os.close(fd)
        total += size
    return cached / total if total else 0.0


# ---- loaders ------------------------------------------------------------------------------------

class PinnedOnlyEngine:
    """A copy engine without a device: every copy completes at once and moves nothing, so a load
    measures the reads into pinned memory alone (the source's bandwidth)."""

    class _Done:
        def wait(self) -> None:
            pass

    def __init__(self):
        import torch

        self.device = torch.device("meta")

    def allocate_device(self, num_bytes):
        import torch

        return torch.empty(num_bytes, dtype=torch.uint8, device="meta")

    def allocate_host(self, num_bytes):
        import torch

        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)

    def register_host(self, tensor) -> bool:
        return False

    def unregister_host(self, tensor) -> None:
        pass

    def copy_async(self, destination, source):
        return self._Done()


class Context:
    """What every measurement of one process shares: the engines, the staging pool, the config."""

    def __init__(self, args):
        import torch

        from loader import CudaCopyEngine, DeviceLoaderConfig, StagingConfig, StagingPool

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.engine = CudaCopyEngine(self.device, num_streams=args.streams)
        self.pinned_only = PinnedOnlyEngine()
        staging = StagingConfig(num_buffers=args.buffers, buffer_bytes=args.buffer_mib << 20)
        self.pool = StagingPool(staging, self.engine.allocate_host)
        self.pool.allocate_all()  # a warm worker's pool: pinned before the load
        self.raw_pool = StagingPool(staging, self.pinned_only.allocate_host)
        self.raw_pool.allocate_all()
        self.configs = {"registered": DeviceLoaderConfig(num_threads=args.threads, register_memory_backed=True),
                        "staged": DeviceLoaderConfig(num_threads=args.threads, register_memory_backed=False)}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_once(loader: str, paths: dict[str, Path], ctx: Context) -> dict:
    """Loads once; returns seconds to every tensor on the GPU, bytes, and what the loader reports."""
    import torch

    from loader import DeviceLoader

    device = ctx.device
    cleanup = None
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    extra: dict = {}
    if loader in ("thaw-registered", "thaw-staged", RAW):
        variant = "staged" if loader == "thaw-staged" else "registered"
        engine, pool = (ctx.pinned_only, ctx.raw_pool) if loader == RAW else (ctx.engine, ctx.pool)
        with DeviceLoader(paths["thaw"], engine, ctx.configs[variant], pool) as ckpt:
            tensors = ckpt.wait_all()
            stats = ckpt.stats
        nbytes = _nbytes(tensors)  # the tensors' bytes, as for the peers (the files' padding left out)
        extra = {"source_kind": stats.source_kind, "direct_io": stats.direct_io,
                 "trusted_bytes": stats.num_trusted_bytes, "threads": stats.num_threads}
    elif loader == "safetensors-load_file":
        from safetensors.torch import load_file

        tensors = load_file(str(paths["safetensors"]), device=str(device))
        nbytes = _nbytes(tensors)
    elif loader == "safetensors-safe_open":
        from safetensors import safe_open

        with safe_open(str(paths["safetensors"]), framework="pt", device=str(device)) as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        nbytes = _nbytes(tensors)
    elif loader == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        tensors = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(str(paths["safetensors"]))
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor.to(device)  # a copy: the streamer reuses its host buffer
        nbytes = _nbytes(tensors)
    elif loader == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        file_loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
        file_loader.add_filenames({0: [str(paths["safetensors"])]})
        buffers = file_loader.copy_files_to_device()
        tensors = {name: buffers.get_tensor(name) for name in file_loader.get_keys()}
        nbytes = _nbytes(tensors)

        def close_buffers():
            buffers.close()  # the tensors are views of its device buffers
            file_loader.close()

        cleanup = close_buffers
    else:
        raise ValueError(f"unknown loader {loader!r}")
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del tensors
    if cleanup is not None:
        cleanup()
    torch.cuda.empty_cache()  # every load allocates its GPU memory afresh
    return {"seconds": seconds, "bytes": nbytes, **extra}


def h2d_gbps(ctx: Context, num_bytes: int, repeats: int = 5) -> float:
    """Pinned host to device, one large copy at a time on one stream: the link's rate."""
    import torch

    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=ctx.device)
    on_device.copy_(host, non_blocking=True)
    torch.cuda.synchronize(ctx.device)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        on_device.copy_(host, non_blocking=True)
        torch.cuda.synchronize(ctx.device)
        best = max(best, num_bytes / (time.perf_counter() - start) / 1e9)
    del host, on_device
    torch.cuda.empty_cache()
    return best


def peer_unavailable(loader: str) -> str | None:
    """Why a peer cannot run here (not installed, or its import fails), else None."""
    module = PEER_MODULES[loader]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"not installed (pip install {PEER_PACKAGES[loader]})"
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer cannot be measured
        return f"import {module} failed: {type(exc).__name__}: {str(exc)[:200]}"
    return None


# ---- the run ------------------------------------------------------------------------------------

def median_gbps(runs: list[dict]) -> float | None:
    good = [r for r in runs if "seconds" in r]
    return statistics.median(r["bytes"] / r["seconds"] / 1e9 for r in good) if good else None


def summarise(source: str, loader: str, runs: list[dict], figures: dict) -> dict:
    """One (source, loader) line; `figures` holds every median of this source and the link's rate."""
    line: dict = {"bench": BENCH, "source": source, "loader": loader}
    good = [r for r in runs if "seconds" in r]
    if not good:
        return line | {"skipped": runs[0].get("error", "failed") if runs else "not run"}
    all_gbps = [r["bytes"] / r["seconds"] / 1e9 for r in good]
    gbps = statistics.median(all_gbps)
    line |= {"gbps": round(gbps, 3), "gbps_all": [round(x, 3) for x in all_gbps],
             "seconds": round(statistics.median(r["seconds"] for r in good), 4), "bytes": good[0]["bytes"]}
    for key in ("source_kind", "direct_io", "threads"):
        if key in good[0]:
            line[key] = good[0][key]
    ours = figures.get(OURS_DEFAULT[source])
    line["thaw_gbps"] = round(ours, 3) if ours else None
    if loader in PEERS:
        line["ratio_thaw_to_this"] = round(ours / gbps, 3) if ours else None
        return line
    if loader == OURS_DEFAULT[source]:
        source_gbps, link = figures.get(RAW), figures.get("h2d-pinned")
        limit = min(x for x in (source_gbps, link) if x) if (source_gbps or link) else None
        peers = {p: round(figures[p], 3) for p in PEERS if figures.get(p)}
        fraction = gbps / limit if limit else None
        ratios = {p: round(gbps / g, 3) for p, g in peers.items()}
        line |= {"source_gbps": round(source_gbps, 3) if source_gbps else None,
                 "h2d_gbps": round(link, 3) if link else None, "limit_gbps": round(limit, 3) if limit else None,
                 "fraction_of_limit": round(fraction, 3) if fraction else None,
                 "peers_gbps": peers, "ratio_thaw_to_peer": ratios,
                 "target": {"fraction_of_limit_at_least": TARGET_FRACTION,
                            "meets_fraction": fraction is not None and fraction >= TARGET_FRACTION,
                            "faster_than_each_peer": bool(ratios) and all(r > 1.0 for r in ratios.values()),
                            "peers_measured": sorted(peers)}}
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~150 MB model, one round (smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16, help="our reader threads")
    parser.add_argument("--buffers", type=int, default=32, help="pinned staging buffers")
    parser.add_argument("--buffer-mib", type=int, default=16, help="size of each staging buffer, MiB")
    parser.add_argument("--streams", type=int, default=2, help="CUDA copy streams")
    parser.add_argument("--work-dir", type=Path, default=None, help="a directory on a disk (not tmpfs)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no round that would end after this")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    import torch

    if not torch.cuda.is_available():
        emit({"bench": BENCH, "skipped": "no CUDA device: this benchmark loads into GPU memory"})
        return 0
    begin = time.monotonic()
    repeats = 1 if args.quick else args.repeats
    from loader.memory_backed import is_memory_backed
    from loader.verification_record import SETTLE_NS

    shapes = model_shapes(args.quick)
    model_bytes = sum(2 * math.prod(shape) for shape in shapes.values())  # bf16
    disk_root = disk_work_dir(args.work_dir, min_free_bytes=3 * model_bytes)
    disk_dir = Path(tempfile.mkdtemp(prefix="thaw-bench-loader-gpu-", dir=disk_root))
    shm = Path("/dev/shm")
    dram_dir = None
    try:
        log(BENCH, f"writing a {model_bytes / 1e9:.2f} GB model to {disk_dir} ({fs_type(disk_dir)})")
        safetensors_path, thaw_dir = write_model(disk_dir, args.quick)
        sources = {"disk": {"safetensors": safetensors_path, "thaw": thaw_dir}}
        if shm.is_dir() and is_memory_backed(shm) and shutil.disk_usage(shm).free > 3 * model_bytes:
            dram_dir = Path(tempfile.mkdtemp(prefix="thaw-bench-loader-gpu-", dir=shm))
            shutil.copy(safetensors_path, dram_dir / "model.safetensors")
            shutil.copytree(thaw_dir, dram_dir / "thaw")
            sources["dram"] = {"safetensors": dram_dir / "model.safetensors", "thaw": dram_dir / "thaw"}
        else:
            emit({"bench": BENCH, "source": "dram", "skipped": "no tmpfs at /dev/shm with room for the model"})
        ctx = Context(args)
        unavailable = {p: peer_unavailable(p) for p in PEERS}
        loaders = {source: [OURS_DEFAULT[source]] + (["thaw-registered"] if source == "dram" else []) + [RAW]
                   + [p for p in PEERS if unavailable[p] is None] for source in sources}
        # The verification record: the platform's loads find one from the node's first load of a
        # copy, written once the files have been still for the record's settling time.
        newest = max(max(st.st_mtime, st.st_ctime) for paths in sources.values()
                     for st in (f.stat() for f in paths["thaw"].iterdir()))
        time.sleep(max(0.0, SETTLE_NS / 1e9 + 0.1 - (time.time() - newest)))  # a wait for the clock
        link = h2d_gbps(ctx, (64 << 20) if args.quick else (1 << 30))
        log(BENCH, "untimed round (library start-up, verification records)")
        for source, paths in sources.items():
            for loader in loaders[source]:
                try:
                    run_once(loader, paths, ctx)
                except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
                    log(BENCH, f"{loader} on {source} failed in the untimed round: {exc}")
        runs: dict[tuple[str, str], list[dict]] = {(s, lo): [] for s in sources for lo in loaders[s]}
        evictions, cached_after = set(), []
        round_s = 0.0
        for round_index in range(repeats):
            if round_index and time.monotonic() - begin + round_s > args.budget_s:
                log(BENCH, f"stopping after {round_index} rounds: the next would pass --budget-s {args.budget_s}")
                break
            round_start = time.monotonic()
            for source, paths in sources.items():
                for loader in loaders[source]:
                    if source == "disk":
                        evictions.add(drop_page_cache(disk_dir))
                        cached_after.append(cached_fraction([paths["safetensors"], *paths["thaw"].glob("*.bin")]))
                    try:
                        runs[source, loader].append(run_once(loader, paths, ctx))
                    except Exception as exc:  # noqa: BLE001
                        runs[source, loader].append({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            round_s = time.monotonic() - round_start
            log(BENCH, f"round {round_index + 1}/{repeats} done in {round_s:.1f} s")
        emit({"bench": BENCH, "loader": "h2d-pinned", "gbps": round(link, 3), "device": torch.cuda.get_device_name()})
        for source in sources:
            figures = {lo: median_gbps(runs[source, lo]) for lo in loaders[source]} | {"h2d-pinned": link}
            for loader in loaders[source]:
                line = summarise(source, loader, runs[source, loader], figures)
                line |= {"model_bytes": model_bytes, "rounds": len(runs[source, loader])}
                if source == "disk":
                    line |= {"eviction": "+".join(sorted(evictions)),
                             "cached_fraction_after_evict": round(max(cached_after), 4) if cached_after else None,
                             "fs": fs_type(disk_dir)}
                emit(line)
            for peer in PEERS:
                if unavailable[peer] is not None:
                    emit({"bench": BENCH, "source": source, "loader": peer, "skipped": unavailable[peer]})
        log(BENCH, f"done in {time.monotonic() - begin:.0f} s")
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        if dram_dir is not None:
            shutil.rmtree(dram_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
