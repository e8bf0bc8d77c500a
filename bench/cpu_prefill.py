"""CPU prefill attention: Thaw's kernels against PyTorch's CPU flash op, on the engine's two shapes.

The two shapes prefill attention takes in the engine (`kernels.cpu_attention`), each KV head's GQA
group folded into its query rows (4 KV heads x 3 query heads, head size 64, the bench model's):

* **causal**: one whole prompt of `prompt_len` tokens, row i seeing keys 0..i. Thaw's kernel
  (`kernel_dense` with per-row limits) against the op with `is_causal` (what `scaled_dot_product_
  attention` runs for a prompt alone; the op with a limits mask is slower still);
* **cascade**: a burst of tails (16-64 tokens) behind one cached prefix of `prefix_len` tokens, each
  tail seeing the prefix and its own keys causally. Thaw's one-pass cascade (`kernel_cascade`)
  against the op's part over the prefix alone (the smaller of the two calls the op needs: the
  peer's figure is flattered).

Per dtype whose kernel this CPU has (float32: AVX-512F; bfloat16: AVX512-BF16): best of `repeats`
timed calls after one warm-up, in ms, GFLOP/s on the flops each shape needs (4 x rows x keys seen x
head size), and the ratio op / Thaw (above 1: Thaw faster). Before timing, each output is checked
against a float64 softmax (float32 within 1e-4, bf16 within 3e-2). One JSON line on stdout.

    python bench/cpu_prefill.py [--quick] [--threads N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.coldstart import machine  # noqa: E402
from kernels.cpu_dense_attention import flash_dense, kernel_cascade, kernel_dense, kernel_usable  # noqa: E402
from kernels.cpu_extension import try_build_cpu_extension  # noqa: E402

KV_HEADS, GROUP, HEAD_SIZE = 4, 3, 64
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def exact(q, k, v, limits) -> torch.Tensor:  # [H, M, D] float64 softmax over each row's first limits keys
    scores = (q.double() @ k.double().transpose(1, 2)) * HEAD_SIZE ** -0.5
    visible = torch.arange(k.shape[1]) < limits.long().unsqueeze(-1)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v.double()


def causal_case(ext, dtype, prompt_len: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(KV_HEADS, GROUP * prompt_len, HEAD_SIZE, generator=gen).to(dtype)  # [Hkv, G*T, D]
    k, v = (torch.randn(KV_HEADS, prompt_len, HEAD_SIZE, generator=gen).to(dtype) for _ in range(2))  # [Hkv, T, D]
    limits = torch.arange(1, prompt_len + 1, dtype=torch.int32).repeat(GROUP)  # [G*T]
    ours = kernel_dense(ext)
    out, _ = ours(q, k, v, limits, HEAD_SIZE ** -0.5)
    error = (out.double() - exact(q, k, v, limits)).abs().max().item()
    if error > TOLERANCE[dtype]:
        raise RuntimeError(f"{dtype} causal kernel off by {error:g}")
    qq = q.view(1, KV_HEADS * GROUP, prompt_len, HEAD_SIZE)  # [1, Hq, T, D]
    kk, vv = (t.repeat_interleave(GROUP, 0).unsqueeze(0) for t in (k, v))  # [1, Hq, T, D]
    thaw_ms = best_ms(lambda: ours(q, k, v, limits, HEAD_SIZE ** -0.5), repeats)
    op_ms = best_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True), repeats)
    flops = 4 * KV_HEADS * GROUP * HEAD_SIZE * prompt_len * (prompt_len + 1) / 2
    return figures(thaw_ms, op_ms, flops)


def cascade_case(ext, dtype, prefix_len: int, num_tails: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    lengths = [16 + (i * 7) % 49 for i in range(num_tails)]
    rows = sum(lengths)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)  # [n+1]
    suffix_limits = torch.cat([torch.arange(1, n + 1, dtype=torch.int32) for n in lengths])  # [R]
    q = torch.randn(KV_HEADS, GROUP * rows, HEAD_SIZE, generator=gen).to(dtype)  # [Hkv, G*R, D]
    kp, vp = (torch.randn(KV_HEADS, prefix_len, HEAD_SIZE, generator=gen).to(dtype) for _ in range(2))
    ks, vs = (torch.randn(KV_HEADS, rows, HEAD_SIZE, generator=gen).to(dtype) for _ in range(2))
    ours = kernel_cascade(ext)

    def call():
        return ours(q, kp, vp, ks, vs, offsets, offsets, suffix_limits, GROUP, HEAD_SIZE ** -0.5)

    out = call()
    first, last = int(offsets[0]), int(offsets[1])  # the first tail, checked whole
    picked = torch.cat([torch.arange(g * rows + first, g * rows + last) for g in range(GROUP)])
    want = exact(q[:, picked], torch.cat([kp, ks[:, first:last]], 1), torch.cat([vp, vs[:, first:last]], 1),
                 (suffix_limits[first:last] + prefix_len).repeat(GROUP))
    error = (out[:, picked].double() - want).abs().max().item()
    if error > TOLERANCE[dtype]:
        raise RuntimeError(f"{dtype} cascade kernel off by {error:g}")
    thaw_ms = best_ms(call, repeats)
    op_ms = best_ms(lambda: flash_dense(q, kp, vp, None, HEAD_SIZE ** -0.5), repeats)  # the op, no mask
    flops = 4 * KV_HEADS * GROUP * HEAD_SIZE * sum(n * prefix_len + n * (n + 1) / 2 for n in lengths)
    return figures(thaw_ms, op_ms, flops)


def figures(thaw_ms: float, op_ms: float, flops: float) -> dict:
    return {"thaw_ms": round(thaw_ms, 3), "op_ms": round(op_ms, 3),
            "thaw_gflops": round(flops / thaw_ms / 1e6, 1), "op_gflops": round(flops / op_ms / 1e6, 1),
            "ratio_op_to_thaw": round(op_ms / thaw_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats (seconds; what CI runs)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case, best kept")
    args = parser.parse_args(argv)
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1):
        parser.error("--threads and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    prompt_len, prefix_len, num_tails = (128, 128, 4) if args.quick else (1064, 1024, 31)
    repeats = args.repeats or (2 if args.quick else 5)
    ext, why = try_build_cpu_extension()
    line = {"bench": "cpu_prefill", "mode": "quick" if args.quick else "full", "threads": args.threads,
            "kv_heads": KV_HEADS, "group": GROUP, "head_size": HEAD_SIZE, "prompt_len": prompt_len,
            "prefix_len": prefix_len, "num_tails": num_tails, "by_dtype": {}, "skipped": {},
            "machine": machine(), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        if not kernel_usable(ext, dtype):
            line["skipped"][name] = why or "this CPU lacks the kernel's instructions"
            print(f"[bench/cpu_prefill] {name}: no kernel here ({line['skipped'][name]})", file=sys.stderr)
            continue
        line["by_dtype"][name] = {"causal": causal_case(ext, dtype, prompt_len, repeats),
                                  "cascade": cascade_case(ext, dtype, prefix_len, num_tails, repeats)}
        for shape, f in line["by_dtype"][name].items():
            print(f"[bench/cpu_prefill] {name} {shape}: thaw {f['thaw_ms']} ms ({f['thaw_gflops']} GFLOP/s), "
                  f"op {f['op_ms']} ms ({f['op_gflops']}): {f['ratio_op_to_thaw']}x", file=sys.stderr)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
