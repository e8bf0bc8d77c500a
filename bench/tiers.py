"""Load time of one model from each tier: repository, node SSD cache, node DRAM cache.

One run builds a random-weight Llama-shaped bf16 model in Hugging Face format (~1 GB: hidden
2048, 8 layers, vocab 32000; ~10 MB with `--quick`), pushes it to a repository (by default a
local directory in the work dir; `--repository s3://bucket/prefix --endpoint-url URL` for S3),
starts a `NodeStore` (with its bandwidth calibration) and measures, for the same model, the
time until every byte is resident and verified in a worker's pre-faulted host buffer (what an
idle pre-started worker has; the loader and pool are the ones the engine uses):

- repository: fetch (parallel ranged reads; a local repository's files are dropped from the page
  cache first, so it is read from disk) of the thaw checkpoint the push converted (the store
  converts only a model an older repository holds in Hugging Face form alone) + rename into the
  SSD cache + load from there;
- ssd: load from the SSD cache with the cache's files dropped from the page cache (cold);
  `warm_seconds` is the same load with every file in the page cache (read there on purpose: the
  loader's O_DIRECT reads do not fill it);
- dram: load from the shared-memory tier (`promote_s` is the one-off SSD -> DRAM copy).

Each line also carries `disk_read_bytes` -- what the process made the kernel read from a block
device during the load (/proc/self/io), 0 for a load that touched no disk -- the store's
calibrated estimate for the tier, and the ratio to the DRAM load.

    python bench/tiers.py [--quick] [--work-dir DIR] [--repeats 3] [--repository URI] [--endpoint-url URL]

Prints one JSON line per tier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "bench-llama"


def write_hf_model(out_dir: Path, quick: bool) -> Path:
    """A Llama-shaped bf16 safetensors model with random weights (kept between runs in --work-dir)."""
    import torch
    from safetensors.torch import save_file

    if (out_dir / "model.safetensors").is_file():
        return out_dir
    hidden, inter, layers, vocab = (256, 704, 2, 8000) if quick else (2048, 5632, 8, 32000)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden // 4, hidden)),
                            ("self_attn.v_proj", (hidden // 4, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):
            tensors[p + name + ".weight"] = rand(*shape)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = rand(vocab, hidden)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 256 or 1, "vocab_size": vocab, "torch_dtype": "bfloat16"}))
    return out_dir


def disk_read_bytes() -> int:
    """Bytes this process (all threads) made the kernel read from a block device."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def drop_from_page_cache(root: Path) -> None:
    """Write back and drop every file under `root` from the page cache, so the next read hits the disk."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_into_page_cache(root: Path) -> None:
    """Read every file under `root` once, buffered, so the next load finds it all cached."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


def timed_load(store, tier: str, pool) -> dict:
    """Load the model from `tier` as a worker does (entry held while loading); seconds until every
    byte is resident and verified, and the disk bytes read meanwhile."""
    from loader import LoaderConfig, ThawCheckpointLoader

    with store.loading(MODEL, tier) as path:
        before = disk_read_bytes()
        start = time.perf_counter()
        with ThawCheckpointLoader(path, LoaderConfig(), pool=pool) as ckpt:
            ckpt.start()
            tensors = ckpt.wait_all()
            seconds = time.perf_counter() - start
            stats = ckpt.stats
            del tensors
        return {"seconds": seconds, "num_bytes": stats.num_bytes, "disk_read_bytes": disk_read_bytes() - before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~10 MB model, one repeat (CI smoke)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the model and caches here (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="median of this many loads per tier")
    parser.add_argument("--repository", default=None, help="repository URI (default: a directory in the work dir)")
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for an s3:// repository")
    args = parser.parse_args()

    from loader import HostMemoryPool
    from storage import NodeStore, NodeStoreConfig, RepositoryConfig, open_repository
    from storage.model_repository import ModelNotFoundError

    repeats = 1 if args.quick else max(1, args.repeats)
    tmp = None
    if args.work_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="thaw-bench-tiers-"))
    work_dir = args.work_dir or tmp
    store = None
    try:
        print(f"[bench/tiers] model and caches in {work_dir}", file=sys.stderr)
        hf_dir = write_hf_model(work_dir / "hf", args.quick)
        repo_uri = args.repository or str(work_dir / "repo")
        if args.repository is None:
            (work_dir / "repo").mkdir(exist_ok=True)
        repository = open_repository(RepositoryConfig(repo_uri, endpoint_url=args.endpoint_url))
        try:
            repository.describe(MODEL)
        except ModelNotFoundError:
            repository.push(hf_dir, MODEL)
        model_bytes = repository.describe(MODEL).total_bytes
        ssd_dir = work_dir / "ssd"
        shutil.rmtree(ssd_dir, ignore_errors=True)
        mib = 1 << 20
        config = NodeStoreConfig(
            ssd_dir=ssd_dir, ssd_capacity_bytes=4 * model_bytes + 64 * mib,
            dram_capacity_bytes=2 * model_bytes + 64 * mib, platform_id=f"bench{os.getpid()}x{uuid.uuid4().hex[:6]}",
            calibration_bytes=(4 if args.quick else 256) * mib, repository_calibration_bytes=(1 if args.quick else 64) * mib)
        store = NodeStore(config, repository)
        bandwidth = store.report().bandwidth
        pool = HostMemoryPool()
        pool.reserve(model_bytes + 64 * mib)  # an idle worker's pre-faulted pool (thaw bytes ~ HF bytes + padding)

        runs: dict[str, list[dict]] = {"repository": [], "ssd": [], "dram": []}
        for _ in range(repeats):
            store.evict(MODEL, "dram")
            store.evict(MODEL, "ssd")
            if not repo_uri.startswith("s3://"):
                for root in (Path(repo_uri) / MODEL, Path(repo_uri) / "_thaw" / MODEL):  # as pushed, converted
                    drop_from_page_cache(root)
            before = disk_read_bytes()
            start = time.perf_counter()
            store.ensure(MODEL, "ssd")
            fetch_convert_s = time.perf_counter() - start
            fetch_disk = disk_read_bytes() - before
            load = timed_load(store, "ssd", pool)
            runs["repository"].append({**load, "seconds": fetch_convert_s + load["seconds"],
                                       "fetch_convert_s": fetch_convert_s,
                                       "disk_read_bytes": fetch_disk + load["disk_read_bytes"]})
        for _ in range(repeats):
            ssd_path = store.ensure(MODEL, "ssd")
            drop_from_page_cache(ssd_path)
            cold = timed_load(store, "ssd", pool)
            read_into_page_cache(ssd_path)  # O_DIRECT loads do not fill the cache: fill it on purpose
            warm = timed_load(store, "ssd", pool)
            runs["ssd"].append({**cold, "warm_seconds": warm["seconds"]})
        start = time.perf_counter()
        store.ensure(MODEL, "dram")
        promote_s = time.perf_counter() - start
        for _ in range(repeats):
            runs["dram"].append({**timed_load(store, "dram", pool), "promote_s": promote_s})

        def median(tier: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[tier])

        dram_s = median("dram", "seconds")
        for tier in ("repository", "ssd", "dram"):
            seconds = median(tier, "seconds")
            num_bytes = runs[tier][0]["num_bytes"]
            estimate = bandwidth.load_s(tier, num_bytes)
            line = {"bench": "tiers", "mode": "quick" if args.quick else "full", "tier": tier,
                    "seconds": round(seconds, 4), "gbps": round(num_bytes / seconds / 1e9, 3), "num_bytes": num_bytes,
                    "disk_read_bytes": int(median(tier, "disk_read_bytes")),
                    "ratio_to_dram": round(seconds / dram_s, 2),
                    "estimated_s": round(estimate, 4) if estimate is not None else None, "repeats": repeats}
            for extra in ("fetch_convert_s", "warm_seconds", "promote_s"):
                if extra in runs[tier][0]:
                    line[extra] = round(median(tier, extra), 4)
            if tier == "repository":
                line["repository"] = repository.uri
            print(json.dumps(line), flush=True)
        return 0
    finally:
        if store is not None:
            store.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
