"""Checkpoint loading: Thaw's chunked format against safetensors, torch.load and fast loaders.

One run writes a Llama-shaped bf16 checkpoint (~2 GB; ~64 MB with `--quick`) as safetensors,
a torch.save file and our thaw format, then measures for every loader the time until every
byte is resident in memory the process owns (a lazy mmap counts only once every page has been
touched), cold (the files evicted from the page cache with posix_fadvise(DONTNEED) first) and
warm (files cached). Each measurement runs in a fresh Python process, so page faults on fresh
memory are paid where a real cold start pays them; ours is measured twice — into a pool that
was reserved and faulted before the clock starts (a warm, idle worker: what the platform uses
at a cold start, since each node keeps pre-started workers) and from a fresh process with no
pool. Its default trusts a partition file it verified at an earlier load and that is unchanged since
(`loader.verification_record`; the bench primes that record with one load before measuring), so
a third line, `thaw-reverify`, hashes every byte again (`trust_verified=False`: what every load
cost before the record, and the paranoid setting). `thaw-dram-tier` loads a copy kept in tmpfs
(the node's DRAM tier), which the loader maps instead of copying; its source is RAM, not the
file, so it is reported beside the disk figures, not as one of them.

The physical limit is measured in the same run: a plain multi-threaded sequential read of the
same bytes into a pre-faulted buffer (O_DIRECT where allowed; the best of --threads and 4
threads), and `dd` (cold). Peers that are
not installed or do not run on this machine get a line saying why. The runs go in rounds, each
taking every loader (and the limit) once, cold then warm: the disk's rate drifts, and the drift
then hits every line alike. Each line gives the median and every run's figure (`gbps_all`).

    python bench/loader.py [--quick] [--work-dir DIR] [--repeats 3] [--threads N] [--loaders thaw,safetensors]

Prints one JSON line per (loader, state) with GB/s and the ratio to the limit. Peers:
`.venv/bin/pip install -e ".[bench]"` to include them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4096


# ---- checkpoint -----------------------------------------------------------------------------

def write_checkpoints(work_dir: Path, quick: bool) -> dict[str, Path]:
    """A Llama-shaped bf16 model: hidden 2048, 16 layers (~2.1 GB), or a tiny one for --quick."""
    import torch
    from safetensors.torch import save_file

    from loader import convert_checkpoint

    hidden, inter, layers, vocab = (256, 704, 4, 8000) if quick else (2048, 5632, 16, 32000)
    hf_dir = work_dir / "hf"
    if not (hf_dir / "model.safetensors").is_file():
        hf_dir.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(0)
        tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
        for i in range(layers):
            p = f"model.layers.{i}."
            for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden // 4, hidden)),
                                ("self_attn.v_proj", (hidden // 4, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                                ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                                ("mlp.down_proj", (hidden, inter))):
                tensors[p + name + ".weight"] = torch.randn(*shape, generator=gen)
            tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
            tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors["model.norm.weight"] = torch.ones(hidden)
        tensors["lm_head.weight"] = torch.randn(vocab, hidden, generator=gen)
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        save_file(tensors, str(hf_dir / "model.safetensors"))
        torch.save(tensors, str(work_dir / "model.pt"))
        (hf_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    thaw_dir = work_dir / "thaw"
    if not (thaw_dir / "thaw_index.json").is_file():
        convert_checkpoint(hf_dir, thaw_dir, progress=False, overwrite=True)
    return {"hf": hf_dir, "safetensors": hf_dir / "model.safetensors", "pt": work_dir / "model.pt", "thaw": thaw_dir}


def data_files(paths: dict[str, Path]) -> list[Path]:
    files = [paths["safetensors"], paths["pt"], *sorted(paths["thaw"].glob("partition_*.bin"))]
    tensorizer_file = paths["hf"].parent / "model.tensors"
    return files + ([tensorizer_file] if tensorizer_file.is_file() else [])


def evict(files: list[Path]) -> None:
    """Drops the files from the page cache (after writing back dirty pages, which DONTNEED
    would otherwise keep). Whether it worked shows in the limit's cold vs warm figures."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- measurements, each in its own process ----------------------------------------------------

def _touch(tensors) -> None:
    """Reads one byte per page of every tensor so lazily mapped memory is really resident."""
    import torch

    total = 0
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        total += int(flat[::PAGE].sum()) if flat.numel() else 0
    return total


def measure(loader: str, paths: dict[str, Path], threads: int, state: str) -> dict:
    """Runs inside the child process: returns seconds until every byte is resident.

    The limit reads with O_DIRECT when cold and through the page cache when warm. Ours runs its
    default configuration in both: it takes what the page cache holds and O_DIRECT-reads the rest."""
    direct = state == "cold"
    import torch

    torch.set_num_threads(max(1, threads))
    nbytes = None
    if loader == "thaw-dram-tier":
        from loader import LoaderConfig, ThawCheckpointLoader

        start = time.perf_counter()
        with ThawCheckpointLoader(paths["thaw-dram"], LoaderConfig()) as ckpt:
            tensors = ckpt.wait_all()
            _touch(tensors.values())
            elapsed = time.perf_counter() - start
            extra = {"mapped": ckpt.stats.mapped, "bytes": ckpt.stats.total_bytes,
                     "trusted_bytes": ckpt.stats.num_trusted_bytes}
            del tensors
        return {"seconds": elapsed, **extra}
    if loader in ("thaw", "thaw-fresh-process", "thaw-reverify"):
        from loader import HostMemoryPool, LoaderConfig, ThawCheckpointLoader, ThawIndex

        index = ThawIndex.read(paths["thaw"])
        nbytes = sum(p.size for p in index.partitions)
        pool = HostMemoryPool()
        if loader != "thaw-fresh-process":
            pool.reserve(nbytes + PAGE * (len(index.partitions) + 1))  # a warm worker's faulted pool
        config = LoaderConfig(trust_verified=loader != "thaw-reverify")
        start = time.perf_counter()
        with ThawCheckpointLoader(paths["thaw"], config, pool=pool) as ckpt:
            ckpt.start()
            tensors = ckpt.wait_all()
            _touch(tensors.values())  # already resident (read into our buffer); touched like every peer
            elapsed = time.perf_counter() - start
            extra = {"direct_io": ckpt.stats.direct_io, "trusted_bytes": ckpt.stats.num_trusted_bytes}
            del tensors
        return {"seconds": elapsed, "bytes": nbytes, **extra}
    if loader == "safetensors":
        from safetensors.torch import load_file

        start = time.perf_counter()
        tensors = load_file(str(paths["safetensors"]))
        _touch(tensors.values())  # recent safetensors versions may map the file lazily
        elapsed = time.perf_counter() - start
        return {"seconds": elapsed, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    if loader == "torch.load-mmap":
        start = time.perf_counter()
        tensors = torch.load(str(paths["pt"]), mmap=True, weights_only=True)
        _touch(tensors.values())
        elapsed = time.perf_counter() - start
        return {"seconds": elapsed, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    if loader == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        start = time.perf_counter()
        tensors = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(str(paths["safetensors"]))
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor.clone()  # the streamer reuses its buffer
        _touch(tensors.values())
        elapsed = time.perf_counter() - start
        return {"seconds": elapsed, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    if loader == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        start = time.perf_counter()
        file_loader = SafeTensorsFileLoader(SingleGroup(), torch.device("cpu"), nogds=True)
        file_loader.add_filenames({0: [str(paths["safetensors"])]})
        buffers = file_loader.copy_files_to_device()
        tensors = {k: buffers.get_tensor(k) for k in buffers.key_to_rank_lidx}
        _touch(tensors.values())
        elapsed = time.perf_counter() - start
        return {"seconds": elapsed, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    if loader == "tensorizer":
        from tensorizer import TensorDeserializer

        tz = paths["hf"].parent / "model.tensors"
        start = time.perf_counter()
        tensors = TensorDeserializer(str(tz), device="cpu", lazy_load=False)
        _touch(tensors.values())
        elapsed = time.perf_counter() - start
        return {"seconds": elapsed, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    if loader == "limit-read":
        files = sorted(paths["thaw"].glob("partition_*.bin"))
        sizes = [f.stat().st_size for f in files]
        buf = torch.empty(sum(sizes) + PAGE, dtype=torch.uint8)
        buf.fill_(0)  # pre-faulted
        base = (-buf.data_ptr()) % PAGE
        chunk = 32 << 20
        tasks, cursor = [], base
        for f, size in zip(files, sizes):
            for off in range(0, size, chunk):
                tasks.append((f, off, min(chunk, size - off), cursor + off))
            cursor += size
        view = memoryview(buf.numpy())
        start = time.perf_counter()

        def read(task):
            nonlocal direct
            path, off, n, dst = task
            flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
            try:
                fd = os.open(path, flags)
            except OSError:
                direct = False
                fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, [view[dst : dst + n]], off)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(max(1, threads)) as ex:
            list(ex.map(read, tasks))
        return {"seconds": time.perf_counter() - start, "bytes": sum(sizes), "direct_io": direct}
    raise ValueError(f"unknown loader {loader!r}")


def run_child(loader: str, paths: dict[str, Path], threads: int, state: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_measure", loader, "--_paths", json.dumps(
        {k: str(v) for k, v in paths.items()}), "--threads", str(threads), "--_state", state]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": last[:300]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def warm_up(files: list[Path]) -> None:
    """Reads the files through the page cache so the warm runs find them there."""
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def dd_cold(paths: dict[str, Path]) -> dict:
    files = sorted(paths["thaw"].glob("partition_*.bin"))
    evict(files)
    start = time.perf_counter()
    total = 0
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True, check=False)
        total += f.stat().st_size
    return {"seconds": time.perf_counter() - start, "bytes": total}


def interleaved_runs(variants: list[tuple[str, int]], paths: dict[str, Path], files: list[Path],
                     repeats: int) -> dict[tuple[tuple[str, int], str], list[dict]]:
    """Fresh-process runs of every (loader, threads) variant, cold (files evicted first) and warm
    (files read first), in ``repeats`` rounds that take each variant once: this disk's rate drifts
    by 2x within minutes, and interleaving lets the drift hit every loader alike (a loader's
    repeats run back to back would compare one minute's disk against another's)."""
    runs: dict[tuple[tuple[str, int], str], list[dict]] = {
        (variant, state): [] for variant in variants for state in ("cold", "warm")}
    for round_index in range(repeats):
        for state in ("cold", "warm"):
            for loader, threads in variants:
                evict(files) if state == "cold" else warm_up(files)
                runs[(loader, threads), state].append(run_child(loader, paths, threads, state))
        print(f"[bench/loader] round {round_index + 1}/{repeats} done", file=sys.stderr, flush=True)
    return runs


def loader_line(loader: str, state: str, runs: list[dict], limit_gbps: float | None) -> dict:
    """One loader's JSON line: median GB/s over its successful runs, every run's figure, the ratio
    to the limit measured in the same rounds."""
    good = [r for r in runs if "seconds" in r]
    line: dict = {"bench": "loader", "loader": loader, "state": state}
    if not good:
        return line | {"skipped": runs[0].get("error", "failed")}
    all_gbps = [r["bytes"] / r["seconds"] / 1e9 for r in good]
    gbps = statistics.median(all_gbps)
    line |= {"gbps": round(gbps, 3), "gbps_all": [round(x, 3) for x in all_gbps],
             "seconds": round(statistics.median(r["seconds"] for r in good), 4),
             "bytes": good[0]["bytes"], "limit_gbps": round(limit_gbps, 3) if limit_gbps else None,
             "ratio_to_limit": round(gbps / limit_gbps, 3) if limit_gbps else None}
    if "direct_io" in good[0]:
        line["direct_io"] = good[0]["direct_io"]
    if "trusted_bytes" in good[0]:  # checksums: hashed by this load, or by an earlier one
        trusted = min(r["trusted_bytes"] for r in good)
        line["checksums"] = ("verified at an earlier load, file unchanged" if trusted == good[0]["bytes"]
                             else "verified by this load" if trusted == 0 else "partly trusted")
    if loader == "thaw-dram-tier":  # not the disk file: a copy in RAM, mapped
        line |= {"source": "DRAM tier (tmpfs copy), mapped", "mapped": good[0].get("mapped")}
    return line


LIMIT_THREADS = 4  # besides --threads: the thread count of our loader's default configuration
PEERS = ("safetensors", "torch.load-mmap", "runai-model-streamer", "tensorizer", "fastsafetensors")
ALL_LOADERS = ("thaw", "thaw-fresh-process", "thaw-reverify", "thaw-dram-tier", *PEERS)
PEER_MODULES = {"runai-model-streamer": "runai_model_streamer", "tensorizer": "tensorizer",
                "fastsafetensors": "fastsafetensors"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~64 MB checkpoint, one repeat (CI smoke run)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where checkpoints are written (kept)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--loaders", default=None,
                        help="comma-separated subset of the loaders to measure (the limit is always measured): "
                             + ", ".join(ALL_LOADERS))
    # The flags run_child gives the measuring child process, hidden from --help.
    parser.add_argument("--_measure", dest="child_loader", help=argparse.SUPPRESS)
    parser.add_argument("--_paths", dest="child_paths", help=argparse.SUPPRESS)
    parser.add_argument("--_state", dest="child_state", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_loader:
        paths = {k: Path(v) for k, v in json.loads(args.child_paths).items()}
        print(json.dumps(measure(args.child_loader, paths, args.threads, args.child_state)))
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    chosen = ALL_LOADERS if args.loaders is None else tuple(x.strip() for x in args.loaders.split(",") if x.strip())
    unknown = sorted(set(chosen) - set(ALL_LOADERS))
    if unknown or not chosen:
        parser.error(f"--loaders: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ALL_LOADERS)}")
    repeats = 1 if args.quick else args.repeats
    tmp = None
    cleanup: list[Path] = []
    work_dir = args.work_dir
    if work_dir is None:
        tmp = tempfile.mkdtemp(prefix="thaw-bench-loader-")
        work_dir = Path(tmp)
    try:
        print(f"[bench/loader] writing checkpoints to {work_dir}", file=sys.stderr)
        paths = write_checkpoints(work_dir, args.quick)
        import importlib.util

        available = {p: importlib.util.find_spec(PEER_MODULES.get(p, "safetensors")) is not None for p in PEERS}
        if available["tensorizer"] and "tensorizer" in chosen:
            try:
                import torch
                from safetensors.torch import load_file
                from tensorizer import TensorSerializer

                serializer = TensorSerializer(str(work_dir / "model.tensors"))
                serializer.write_state_dict(load_file(str(paths["safetensors"])))
                serializer.close()
                del torch
            except Exception as exc:  # noqa: BLE001
                available["tensorizer"] = False
                print(f"[bench/loader] tensorizer could not serialize: {exc}", file=sys.stderr)
        files = data_files(paths)
        from loader.memory_backed import is_memory_backed

        shm = Path("/dev/shm")
        if shm.is_dir() and is_memory_backed(shm):  # the node's DRAM tier keeps checkpoints in tmpfs
            dram_dir = Path(tempfile.mkdtemp(prefix="thaw-bench-loader-", dir=shm))
            cleanup.append(dram_dir)
            shutil.copytree(paths["thaw"], dram_dir / "thaw")
            paths["thaw-dram"] = dram_dir / "thaw"
        else:
            available["thaw-dram-tier"] = False
        # The platform's loads find the record of an earlier verified load (a node verifies a copy
        # the first time it loads it); one load of each copy here writes it, once the files have
        # been still for the record's settling time.
        from loader import ThawCheckpointLoader
        from loader.verification_record import SETTLE_NS

        copies = [c for c in (paths["thaw"], paths.get("thaw-dram")) if c is not None]
        changed = max(max(st.st_mtime, st.st_ctime) for c in copies for st in (f.stat() for f in c.iterdir()))
        time.sleep(max(0.0, SETTLE_NS / 1e9 + 0.1 - (time.time() - changed)))  # a wait for the clock, not a sync
        for copy in copies:
            with ThawCheckpointLoader(copy) as primer:
                primer.wait_all()
        measured = []
        for loader in chosen:
            if loader == "thaw-dram-tier" and not available.get(loader, True):
                print(json.dumps({"bench": "loader", "loader": loader, "skipped": "no tmpfs at /dev/shm"}), flush=True)
            elif not available.get(loader, True):
                print(json.dumps({"bench": "loader", "loader": loader, "skipped":
                                  f"not installed (pip install {loader})" if loader != "tensorizer" or
                                  importlib.util.find_spec("tensorizer") is None else "serialization failed"}),
                      flush=True)
            else:
                measured.append(loader)
        # The best of several thread counts for the limit (ours reads with 4): a disk may need a
        # deeper queue than the core count to reach its rate, and the limit must not be the weaker reader.
        limit_variants = [("limit-read", t) for t in sorted({args.threads, LIMIT_THREADS})]
        runs = interleaved_runs(limit_variants + [(loader, args.threads) for loader in measured], paths, files,
                                repeats)
        limits = {}
        for state in ("cold", "warm"):
            best, best_threads, direct = None, None, None
            for variant in limit_variants:
                good = [r for r in runs[variant, state] if "seconds" in r]
                if good:
                    gbps = statistics.median(r["bytes"] / r["seconds"] / 1e9 for r in good)
                    if best is None or gbps > best:
                        best, best_threads, direct = gbps, variant[1], good[0].get("direct_io")
            limits[state] = best
            print(json.dumps({"bench": "loader", "loader": "limit-read", "state": state,
                              "gbps": round(best, 3) if best else None, "threads": best_threads,
                              "direct_io": direct}), flush=True)
        dd = dd_cold(paths)
        print(json.dumps({"bench": "loader", "loader": "dd", "state": "cold",
                          "gbps": round(dd["bytes"] / dd["seconds"] / 1e9, 3)}), flush=True)
        for loader in measured:
            for state in ("cold", "warm"):
                print(json.dumps(loader_line(loader, state, runs[(loader, args.threads), state], limits[state])),
                      flush=True)
    finally:
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
