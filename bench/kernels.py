"""Decode paged-attention bandwidth: our Triton kernel against PyTorch SDPA on gathered K/V.

For each (batch, context) shape, a Llama-3-8B-like attention layer (32 query heads, 8 KV
heads, head size 128, 16-token blocks, bf16) decodes one token per sequence over a paged KV
cache whose blocks are shuffled across the pool. Our figure is the Triton kernel reading K/V
straight through the block table; the peer's is `torch.nn.functional.scaled_dot_product_attention`
over the same K/V already gathered into contiguous ``[B, Hkv, L, D]`` tensors (the gather is
not timed, which flatters the peer). Achieved bandwidth counts the K/V bytes each must read
once; it is reported in GB/s and as a share of the device's peak HBM bandwidth.

Both sides are timed as CUDA-graph replays (the engine replays its decode steps from graphs
too), so the figures are the GPU's time rather than Python's launch overhead. Decode batches use
the split-KV kernel (`kernels.triton_decode`); ``--sweep`` times its launch variants (tokens per
iteration, warps, pipeline stages, target programs per SM) on the target shapes.

Target (issue 3): >= 70% of peak HBM bandwidth on an H100 for batch >= 16 at context >= 4096.
Prints one JSON line per shape. Without CUDA it prints one line saying so and exits 0.

    python bench/kernels.py [--quick] [--sweep] [--dtype bfloat16] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import AttentionMetadata, get_attention_backend  # noqa: E402

# Peak HBM bandwidth by device name (GB/s), from the vendors' datasheets.
PEAK_GBPS = {"H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "H200": 4800.0,
             "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "A100-PCIE": 1935.0, "L40S": 864.0}
TARGET_FRACTION = 0.70
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
FULL_GRID = [(b, c) for b in (1, 16, 64, 256) for c in (512, 4096, 32768)]
QUICK_GRID = [(1, 512), (16, 512)]
SWEEP_GRID = [(1, 32768), (16, 4096), (16, 32768), (64, 4096), (256, 4096)]


def peak_bandwidth_gbps(name: str) -> float | None:
    for key in sorted(PEAK_GBPS, key=len, reverse=True):
        if key in name:
            return PEAK_GBPS[key]
    return None


def time_graph_ms(fn, iters: int, replays: int = 10) -> float:
    """Median ms of one call of `fn`, captured in a CUDA graph and replayed `replays` times between
    two events: the GPU's time, not Python's launch time (the engine replays decode steps from
    graphs too, `worker.engine.decode_graphs`). `fn` runs once first, outside the graph, to compile."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def make_decode_batch(batch: int, context: int, dtype: torch.dtype):
    """(query, key_cache, value_cache, metadata) of one decode step, blocks shuffled over the pool."""
    device = torch.device("cuda")
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        block_tables=tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_lens_host=(1,) * batch,
        seq_lens_host=(context,) * batch,
    )
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    return query, key_cache, value_cache, meta


def kv_bytes_of(batch: int, context: int, dtype: torch.dtype) -> int:
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def sweep_shape(batch: int, context: int, dtype: torch.dtype, iters: int, peak: float | None,
                variants: list[tuple[int, int, int, int]]) -> list[dict]:
    """Our decode kernel only, once per (block_n, num_warps, num_stages, waves): picks the defaults."""
    from kernels.triton_attention import TritonAttentionBackend

    query, key_cache, value_cache, meta = make_decode_batch(batch, context, dtype)
    kv_bytes = kv_bytes_of(batch, context, dtype)
    lines = []
    for block_n, warps, stages, waves in variants:
        backend = TritonAttentionBackend(decode_block_n=block_n, decode_num_warps=warps, decode_num_stages=stages,
                                         decode_waves=waves)
        ms = time_graph_ms(lambda: backend.paged_attention(query, key_cache, value_cache, meta, HEAD_DIM ** -0.5), iters)
        gbps = kv_bytes / ms / 1e6
        lines.append({"bench": "kernels-sweep", "batch": batch, "context": context, "block_n": block_n,
                      "num_warps": warps, "num_stages": stages, "waves": waves, "thaw_ms": round(ms, 4), "thaw_gbps": round(gbps, 1),
                      "thaw_peak_fraction": round(gbps / peak, 3) if peak else None})
    key_cache = value_cache = None  # free the pool before the next shape
    torch.cuda.empty_cache()
    return lines


def run_shape(batch: int, context: int, dtype: torch.dtype, iters: int, peak: float | None) -> dict:
    kv_bytes = kv_bytes_of(batch, context, dtype)
    free_bytes, _ = torch.cuda.mem_get_info()
    if 3.2 * kv_bytes > free_bytes:  # the pool, plus the peer's gathered copy and its temporary
        return {"bench": "kernels", "batch": batch, "context": context,
                "skipped": f"needs {3.2 * kv_bytes / 2**30:.1f} GiB, {free_bytes / 2**30:.1f} GiB free"}
    query, key_cache, value_cache, meta = make_decode_batch(batch, context, dtype)
    device, tables = query.device, meta.block_tables
    scale = HEAD_DIM ** -0.5
    backend = get_attention_backend(device, prefer="triton")
    ours = backend.paged_attention(query, key_cache, value_cache, meta, scale)
    ours_ms = time_graph_ms(lambda: backend.paged_attention(query, key_cache, value_cache, meta, scale), iters)

    flat_ids = tables.reshape(-1).long()
    keys = key_cache.index_select(0, flat_ids).view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    values = value_cache.index_select(0, flat_ids).view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    q4 = query.unsqueeze(2)  # [B, Hq, 1, D]

    def peer():
        return torch.nn.functional.scaled_dot_product_attention(q4, keys, values, scale=scale, enable_gqa=True)

    max_error = (peer().squeeze(2).float() - ours.float()).abs().max().item()
    peer_ms = time_graph_ms(peer, iters)
    ours_gbps = kv_bytes / ours_ms / 1e6
    peer_gbps = kv_bytes / peer_ms / 1e6
    key_cache = value_cache = keys = values = None  # free the pool before the next shape
    torch.cuda.empty_cache()
    return {
        "bench": "kernels", "batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."),
        "kv_bytes": kv_bytes,
        "thaw_ms": round(ours_ms, 4), "sdpa_gathered_ms": round(peer_ms, 4),
        "thaw_gbps": round(ours_gbps, 1), "sdpa_gathered_gbps": round(peer_gbps, 1),
        "ratio": round(ours_gbps / peer_gbps, 3),
        "peak_gbps": peak,
        "thaw_peak_fraction": round(ours_gbps / peak, 3) if peak else None,
        "target_peak_fraction": TARGET_FRACTION if batch >= 16 and context >= 4096 else None,
        "max_abs_error_vs_sdpa": round(max_error, 5),
        "device": torch.cuda.get_device_name(device),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes (seconds)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true",
                        help="time our decode kernel's launch variants on the target shapes (no peer)")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "kernels", "mode": "quick" if args.quick else "full",
                          "skipped": "no CUDA device: this benchmark measures GPU memory bandwidth"}))
        return 0
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth_gbps(name)
    if peak is None:
        print(f"[bench/kernels] unknown peak bandwidth for {name!r}; fractions omitted", file=sys.stderr)
    dtype = getattr(torch, args.dtype)
    if args.sweep:
        variants = [(n, w, st, wv) for n in (64, 128) for w in (4, 8) for st in (2, 3) for wv in (2, 4)]
        for batch, context in SWEEP_GRID:
            for line in sweep_shape(batch, context, dtype, args.iters, peak, variants):
                print(json.dumps(line), flush=True)
        return 0
    for batch, context in QUICK_GRID if args.quick else FULL_GRID:
        print(json.dumps(run_shape(batch, context, dtype, args.iters, peak)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
