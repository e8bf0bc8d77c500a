"""Scale-out benchmark: time to first token of requests that arrive while a new instance starts,
when it loads from SSD, streams its weights from a running peer, or streams and computes layer by
layer as the weights land (BlitzScale's zigzag); and the time of a chain multicast to 1 vs 3
receivers.

One run writes a random Llama (`worker.write_demo_model`, bf16, ~1 GB: the coldstart model) and
converts it to the thaw format (the node's SSD copy). Every party is its own process (multiprocessing
"spawn"), as workers are:

* the **peer**: a process that holds the model in memory (loaded with the thaw loader, as a running
  instance does) and streams it with `loader.LayerStreamSource` over gloo on loopback;
* the **new instance**: a process warmed up like the platform's spare workers (torch imported, a
  tiny model run once, a pre-faulted weight buffer), which the clock starts on. Then:
  - ``ssd``: `Engine(ssd_copy)` with the page cache dropped first, then serves;
  - ``stream``: `LayerStreamReceiver.wait_all()`, then `Engine(weights=receiver)` (all in), then serves;
  - ``zigzag``: `Engine(weights=receiver)` at once; requests are admitted and stepped while the
    layers arrive (`worker.loading.layer_gate`, `worker.engine.zigzag_prefill`).
  ``--requests`` requests (a ``--prompt-tokens`` prompt of random ids, greedy, 1 output token)
  arrive at the new instance ``--gap-s`` apart from the moment the scale-out starts; each one's
  TTFT runs from its arrival to its token. The case's figure is the mean TTFT.
* multicast: the peer streams to 1 receiver, then to a chain of 3 (each forwarding to the next
  while it receives); the figure is the time from the start until the last receiver has every
  byte. The link bandwidth reported is the 1-receiver rate.

Targets (issue 9): zigzag mean TTFT at most half of ssd's; 3-way multicast at most 1.3x a single
transfer. On a CPU machine the interconnect is loopback and the "link" shares the 2 cores with the
compute: the line says so. One JSON line per case on stdout, progress on stderr.

    python bench/scaleout.py [--quick] [--repeats N] [--work-dir DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT_WAIT_S = 600  # a guard: a child that never answers fails the bench instead of hanging it


@dataclass(frozen=True)
class Mode:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompt_tokens: int
    requests: int
    gap_s: float
    repeats: int


FULL = Mode("full", 2048, 8, 32, 8, 5632, 32000, prompt_tokens=128, requests=4, gap_s=0.1, repeats=3)
QUICK = Mode("quick", 64, 2, 4, 2, 128, 1024, prompt_tokens=16, requests=2, gap_s=0.02, repeats=1)


def log(message: str) -> None:
    print(f"[scaleout] {message}", file=sys.stderr, flush=True)


def write_model(work_dir: Path, mode: Mode) -> Path:
    """The model's thaw-format SSD copy (written once per work dir)."""
    from loader import convert_checkpoint
    from worker import DemoModelConfig, write_demo_model

    thaw_dir = work_dir / f"thaw-{mode.name}"
    if not (thaw_dir / "thaw_index.json").is_file():
        config = DemoModelConfig(hidden_size=mode.hidden, num_hidden_layers=mode.layers,
                                 num_attention_heads=mode.heads, num_key_value_heads=mode.kv_heads,
                                 intermediate_size=mode.intermediate, vocab_size=mode.vocab,
                                 max_position_embeddings=2048, dtype="bfloat16", seed=0)
        hf_dir = write_demo_model(work_dir / f"hf-{mode.name}", config, overwrite=True)
        convert_checkpoint(hf_dir, thaw_dir, progress=False)
    return thaw_dir


def evict(ckpt_dir: Path) -> None:
    """Drop the checkpoint's pages from the page cache (a cold SSD read)."""
    os.sync()
    for path in ckpt_dir.glob("partition_*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- child processes -------------------------------------------------------------------------

def run_peer(conn, ckpt_dir: str, num_receivers: int, threads: int) -> None:
    """The running peer: holds the weights, streams them to `num_receivers` chained receivers."""
    import torch

    from loader import LayerStreamSource, StreamConfig, load_checkpoint

    torch.set_num_threads(threads)
    tensors, _ = load_checkpoint(ckpt_dir)
    source = LayerStreamSource(tensors, num_receivers, StreamConfig(timeout_s=120.0))
    conn.send(("rendezvous", source.rendezvous))
    try:
        conn.recv()  # go
        source.start()
        stats = source.wait()
        conn.send(("done", stats.elapsed_s, stats.num_bytes))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        source.close()


def _pool(num_bytes: int):
    from loader import HostMemoryPool

    pool = HostMemoryPool()
    pool.reserve(num_bytes + (1 << 20))  # faulted ahead, like a spare worker's reserved memory
    return pool


def run_receiver(conn, rendezvous, rank: int, num_bytes: int, threads: int) -> None:
    """A multicast receiver: every byte in (and forwarded), then the time since `go`."""
    import torch

    from loader import LayerStreamReceiver, StreamConfig

    torch.set_num_threads(threads)
    pool = _pool(num_bytes)
    conn.send(("ready",))
    conn.recv()
    start = time.perf_counter()
    with LayerStreamReceiver(rendezvous, rank, StreamConfig(timeout_s=120.0), pool=pool) as receiver:
        receiver.start()
        tensors = receiver.wait_all()
        received_s = time.perf_counter() - start
        del tensors
        receiver.wait_forwarded()
    conn.send(("done", received_s))


def run_instance(conn, case: str, ckpt_dir: str, rendezvous, mode: Mode, threads: int, num_bytes: int,
                 seed: int) -> None:
    """The new instance: scale out by `case`, serve the requests arriving meanwhile; reports TTFTs."""
    import random

    import torch

    from loader import LayerStreamReceiver, StreamConfig
    from worker.engine.engine import Engine
    from worker.engine.engine_config import EngineConfig
    from worker.serving.process_warmup import warm_up_process
    from worker.loading.reserved_memory import ReservedMemory
    from wire.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    warm_up_process()  # what a spare worker pays before it is given a model (imports, first kernels)
    reserved = ReservedMemory(weight_bytes=num_bytes + (1 << 20)) if case == "ssd" else None
    pool = _pool(num_bytes) if case != "ssd" else None
    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=256 << 20)
    rng = random.Random(seed)
    prompts = [[rng.randrange(mode.vocab) for _ in range(mode.prompt_tokens)] for _ in range(mode.requests)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    conn.send(("ready",))
    conn.recv()  # go: the scale-out starts now
    start = time.perf_counter()
    arrivals = [start + i * mode.gap_s for i in range(mode.requests)]
    receiver = None
    if case == "ssd":
        engine = Engine(ckpt_dir, config, reserved=reserved)
    else:
        receiver = LayerStreamReceiver(rendezvous, 1, StreamConfig(timeout_s=120.0), pool=pool)
        receiver.start()
        if case == "stream":
            receiver.wait_all()
        engine = Engine(ckpt_dir, config, weights=receiver)  # reads config + tokenizer only
    ttft: dict[str, float] = {}
    admitted: dict[str, float] = {}
    while len(ttft) < mode.requests:
        now = time.perf_counter()
        for i, at in enumerate(arrivals):
            rid = f"r{i}"
            if at <= now and rid not in admitted:
                engine.add_request(prompts[i], params, request_id=rid)
                admitted[rid] = at
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = time.perf_counter() - admitted[out.request_id]
        else:  # pacing until the next arrival (nothing to synchronise with: the arrival is the clock)
            time.sleep(max(0.0, min(at for at in arrivals if at > now) - now) if any(a > now for a in arrivals) else 0)
    resident_s = engine.load_s
    conn.send(("done", [ttft[f"r{i}"] for i in range(mode.requests)], resident_s, engine.load_report))
    if receiver is not None:
        receiver.close()


# ---- orchestration --------------------------------------------------------------------------

def _expect(conn, kind: str, who: str):
    if not conn.poll(RESULT_WAIT_S):
        raise RuntimeError(f"{who} did not answer within {RESULT_WAIT_S} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"{who}: {message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"{who} sent {message[0]!r}, expected {kind!r}")
    return message


def _spawn(ctx, target, *args):
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    return process, parent


def scale_out_once(ctx, case: str, ckpt_dir: Path, mode: Mode, threads: int, num_bytes: int, seed: int) -> dict:
    peer = None
    rendezvous = None
    if case != "ssd":
        peer, peer_conn = _spawn(ctx, run_peer, str(ckpt_dir), 1, threads)
        rendezvous = _expect(peer_conn, "rendezvous", "the peer")[1]
    else:
        evict(ckpt_dir)
    instance, conn = _spawn(ctx, run_instance, case, str(ckpt_dir), rendezvous, mode, threads, num_bytes, seed)
    try:
        _expect(conn, "ready", "the new instance")
        if peer is not None:
            peer_conn.send("go")
        conn.send("go")
        _, ttfts, resident_s, report = _expect(conn, "done", "the new instance")
        if peer is not None:
            _expect(peer_conn, "done", "the peer")
        return {"ttft_s": ttfts, "resident_s": resident_s, "report": report}
    finally:
        for process in (instance, peer):
            if process is not None:
                process.join(30)
                if process.is_alive():
                    process.kill()


def multicast_once(ctx, ckpt_dir: Path, num_receivers: int, threads: int, num_bytes: int) -> dict:
    peer, peer_conn = _spawn(ctx, run_peer, str(ckpt_dir), num_receivers, threads)
    rendezvous = _expect(peer_conn, "rendezvous", "the peer")[1]
    receivers = [_spawn(ctx, run_receiver, rendezvous, rank, num_bytes, threads) for rank in range(1, num_receivers + 1)]
    try:
        for rank, (_, conn) in enumerate(receivers, 1):
            _expect(conn, "ready", f"receiver {rank}")
        start = time.perf_counter()
        peer_conn.send("go")
        for _, conn in receivers:
            conn.send("go")
        received = [_expect(conn, "done", f"receiver {rank}")[1] for rank, (_, conn) in enumerate(receivers, 1)]
        total_s = time.perf_counter() - start
        _expect(peer_conn, "done", "the peer")
        return {"total_s": total_s, "received_s": received}
    finally:
        for process, _ in (*receivers, (peer, None)):
            process.join(30)
            if process.is_alive():
                process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one try (CI smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="tries per case (default 3; quick 1)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the model is written (kept)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads per process")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    repeats = args.repeats if args.repeats is not None else mode.repeats
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    tmp = tempfile.TemporaryDirectory(prefix="thaw-scaleout-") if args.work_dir is None else None
    work_dir = Path(tmp.name) if tmp else args.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        log(f"writing the {mode.name} model to {work_dir}")
        ckpt_dir = write_model(work_dir, mode)
        from loader import ThawIndex

        num_bytes = ThawIndex.read(ckpt_dir).total_bytes
        ctx = mp.get_context("spawn")
        common = {"bench": "scaleout", "mode": mode.name, "model_bytes": num_bytes, "prompt_tokens": mode.prompt_tokens,
                  "requests": mode.requests, "gap_s": mode.gap_s, "threads": args.threads,
                  "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
                  "interconnect": "loopback TCP (gloo), sharing the CPUs with compute"}
        results: dict[str, list[dict]] = {"ssd": [], "stream": [], "zigzag": []}
        for attempt in range(repeats):
            for case in results:  # interleaved, so drift hits every case alike
                run = scale_out_once(ctx, case, ckpt_dir, mode, args.threads, num_bytes, seed=attempt)
                log(f"{case} try {attempt + 1}: TTFT {', '.join(f'{t:.3f}' for t in run['ttft_s'])} s; "
                    f"weights resident after {run['resident_s']:.3f} s")
                results[case].append(run)
        means = {case: statistics.median(statistics.mean(r["ttft_s"]) for r in runs) for case, runs in results.items()}
        for case, runs in results.items():
            line = common | {"case": case, "mean_ttft_s": round(means[case], 4),
                             "mean_ttft_all_s": [round(statistics.mean(r["ttft_s"]), 4) for r in runs],
                             "ttft_s": [[round(t, 4) for t in r["ttft_s"]] for r in runs],
                             "weights_resident_s": [round(r["resident_s"] or 0.0, 4) for r in runs],
                             "peer": "ssd", "peer_mean_ttft_s": round(means["ssd"], 4),
                             "ratio_to_ssd": round(means[case] / means["ssd"], 3)}
            if case == "zigzag":
                line |= {"target_ratio": 0.5, "target_met": means[case] <= 0.5 * means["ssd"]}
            print(json.dumps(line), flush=True)
        multicast = {}
        for n in (1, 3):
            runs = [multicast_once(ctx, ckpt_dir, n, max(1, args.threads // 2), num_bytes) for _ in range(repeats)]
            multicast[n] = statistics.median(r["total_s"] for r in runs)
            times = ", ".join(f"{r['total_s']:.3f}" for r in runs)
            log(f"multicast to {n}: {times} s")
        link = num_bytes / multicast[1] / 1e9
        for n in (1, 3):
            line = common | {"case": f"multicast-{n}", "total_s": round(multicast[n], 4),
                             "link_gbps": round(link, 3), "peer": "multicast-1",
                             "peer_total_s": round(multicast[1], 4), "ratio_to_single": round(multicast[n] / multicast[1], 3)}
            if n == 3:
                line |= {"target_ratio": 1.3, "target_met": multicast[3] <= 1.3 * multicast[1]}
            print(json.dumps(line), flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
