"""Deploy benchmark: a real-size checkpoint from the caller's side to its first token (#37).

It writes a Llama-3-8B-shaped Hugging Face checkpoint with random bf16 weights (hidden 4096, 32
layers, 32 query / 8 KV heads, MLP 14336, vocab 128256: 8.03B parameters, 16.1 GB, in 2 GB
shards; ``--quick``: a 4-layer, hidden-256 model of a few MB), starts a platform (`infra.Platform`
in this process, no auth, no DRAM tier), and deploys the directory the way ``thaw deploy
--upload`` does (`infra.source_upload` then a deploy job followed by long polls), timing:

* ``send_s``: the directory sent through the admin API in 4 MiB pieces and sealed (every file
  hashed on both sides);
* the deploy job's stages, as the long polls first saw each (``checking``: the source hashed for
  the manifest; ``converting``: safetensors -> the thaw format; ``uploading``: into the local
  repository, a rename since the conversion is the push's own); ``deploy_s`` from the job's start
  to its end;
* ``first_token_s``: a chat request right after, through the cold start (the node store copies
  the checkpoint from the repository to its SSD tier, a worker loads it).

The floor, measured in the same run on the same disk: copying the checkpoint once
(``copy_file_range`` of a 1 GiB probe, scaled to the checkpoint's bytes) -- the least any deploy
that stores the model once must spend. ``ratio_to_floor`` = (send_s + deploy_s) / floor_s.

    python bench/deploy.py [--quick] [--work-dir DIR]

One JSON line on stdout, progress on stderr. Needs ~70 GB of free disk for the full size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1 << 30
PROBE_BYTES = GIB
FULL_SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256}
QUICK_SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
               "intermediate_size": 688, "vocab_size": 1024}
SHARD_BYTES = 2 * GIB
DEADLINE_S = 3600.0


def log(message: str) -> None:
    print(f"[deploy-bench] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_checkpoint(out: Path, shape: dict[str, int]) -> int:
    """A Llama checkpoint of `shape` with random bf16 weights, written shard by shard (never the
    whole model in memory); returns its weights' bytes. Tokenizer and configs from the demo model."""
    import torch
    from safetensors.torch import save_file

    from worker import DemoModelConfig, write_demo_model

    write_demo_model(out, DemoModelConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, seed=1), overwrite=True)
    (out / "model.safetensors").unlink()
    config = json.loads((out / "config.json").read_text())
    config.update(shape, dtype="bfloat16", torch_dtype="bfloat16", max_position_embeddings=2048, tie_word_embeddings=False,
                  head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h, kv = shape["hidden_size"], shape["num_key_value_heads"] * shape["hidden_size"] // shape["num_attention_heads"]
    inter, vocab = shape["intermediate_size"], shape["vocab_size"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                    (p + "post_attention_layernorm.weight", (h,))]
    tensors += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, Any]] = [{}]
    shard_bytes, total, weight_map = 0, 0, {}
    names = []

    def flush() -> None:
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        names.append(name)
        shards[-1] = {}

    for tensor_name, dims in tensors:
        if len(dims) == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(dims, generator=generator) * 0.02).to(torch.bfloat16)
        num_bytes = tensor.numel() * 2
        if shard_bytes and shard_bytes + num_bytes > SHARD_BYTES:
            flush()
            shard_bytes = 0
        shards[-1][tensor_name] = tensor
        weight_map[tensor_name] = len(names)
        shard_bytes += num_bytes
        total += num_bytes
    flush()
    final = {}
    for index, name in enumerate(names):  # safetensors' shard names say "of N"
        final[index] = f"model-{index + 1:05d}-of-{len(names):05d}.safetensors"
        os.replace(out / name, out / final[index])
    index = {"metadata": {"total_size": total}, "weight_map": {t: final[i] for t, i in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def copy_rate(directory: Path) -> float:
    """Bytes per second of one file copy (copy_file_range) on this disk, page cache dropped where possible."""
    src, dst = directory / ".probe-src", directory / ".probe-dst"
    block = os.urandom(64 << 20)
    with open(src, "wb") as f:
        for _ in range(PROBE_BYTES // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    os.posix_fadvise(os.open(src, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        offset = 0
        while offset < PROBE_BYTES:
            offset += os.copy_file_range(fin.fileno(), fout.fileno(), PROBE_BYTES - offset)
        os.fsync(fout.fileno())
    elapsed = time.perf_counter() - start
    src.unlink()
    dst.unlink()
    return PROBE_BYTES / elapsed


async def deploy(url: str, state_dir: Path, model_dir: Path) -> dict[str, Any]:
    from infra.admin_client import AdminClient
    from infra.source_upload import ResumeRecords, upload_directory

    async with AdminClient(url, None, timeout_s=DEADLINE_S) as client:
        start = time.perf_counter()
        upload_id = await upload_directory(client, model_dir, ResumeRecords(state_dir))
        send_s = time.perf_counter() - start
        spec = {"tenant": "bench", "name": "llama8b", "source": f"upload:{upload_id}", "max_model_len": 1024,
                "resources": {"num_cpus": 2},
                "autoscaling": {"min_instances": 0, "max_instances": 1, "queue_timeout_s": DEADLINE_S}}
        job_start = time.perf_counter()
        record = await client.start_deploy(spec)
        stage_seen: dict[str, float] = {}
        while not record.finished:
            stage_seen.setdefault(record.stage.value, time.perf_counter() - job_start)
            record = await client.deploy_status(record.deploy_id, wait_s=0.5)
        if record.error is not None:
            raise RuntimeError(f"the deploy failed: {record.error}")
        deploy_s = time.perf_counter() - job_start
        order = ["checking", "converting", "uploading", "registering"]
        seen = [s for s in order if s in stage_seen]
        stages = {s: round((stage_seen[seen[i + 1]] if i + 1 < len(seen) else deploy_s) - stage_seen[s], 2)
                  for i, s in enumerate(seen)}
        return {"send_s": round(send_s, 2), "deploy_s": round(deploy_s, 2), "stages_s": stages,
                "deploy_wall_s": round(record.elapsed_s or deploy_s, 2)}


def first_token_s(url: str, timeout_s: float) -> float:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s)
    start = time.perf_counter()
    stream = client.chat.completions.create(model="bench/llama8b", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return round(first if first is not None else time.perf_counter() - start, 2)


async def _status(url: str) -> dict[str, Any]:
    from infra.admin_client import AdminClient

    async with AdminClient(url, None) as client:
        status = await client.status()
    return {"models": status.get("models"), "instances": status.get("instances"),
            "decisions": status.get("recent_decisions", [])[-8:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a model of a few MB (CI smoke run)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the model and state go (default: a temp dir)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="thaw-deploy-bench-", dir=args.work_dir))
    try:
        from infra.platform import Platform
        from infra.platform_config import PlatformConfig

        shape = QUICK_SHAPE if args.quick else FULL_SHAPE
        log(f"writing the checkpoint ({'quick' if args.quick else 'Llama-3-8B-shaped'}) ...")
        start = time.perf_counter()
        weight_bytes = write_checkpoint(work / "model", shape)
        log(f"  {weight_bytes / 1e9:.2f} GB of weights in {time.perf_counter() - start:.0f} s")
        floor_bytes_per_s = copy_rate(work)
        log(f"disk copy rate {floor_bytes_per_s / 1e9:.2f} GB/s")
        port = free_port()
        config = PlatformConfig.create(state_dir=work / "state", port=port, namespace=f"deploybench{uuid.uuid4().hex[:8]}",
                                       auth=False, num_cpus=4, ssd_capacity_bytes=64 * GIB, dram_capacity_bytes=0,
                                       calibrate=False, spare_workers_per_node=0)
        platform = Platform(config)
        platform.start()
        try:
            log("deploying from the caller's side ...")
            figures = asyncio.run(deploy(config.url, work / "state", work / "model"))
            log(f"  {figures}")
            log("first request (cold start) ...")
            try:
                ttft = first_token_s(config.url, 300.0 if args.quick else DEADLINE_S)
            except Exception:
                status = asyncio.run(_status(config.url))
                log(f"no first token; the controller says: {json.dumps(status)[:4000]}")
                raise
        finally:
            platform.stop()
        floor_s = weight_bytes / floor_bytes_per_s
        total_s = figures["send_s"] + figures["deploy_s"]
        print(json.dumps({
            "bench": "deploy", "mode": "quick" if args.quick else "full", "model_bytes": weight_bytes,
            **figures, "first_token_s": ttft, "total_s": round(total_s, 2),
            "floor_copy_bytes_per_s": round(floor_bytes_per_s), "floor_s": round(floor_s, 4),
            "ratio_to_floor": round(total_s / floor_s, 2),
            "effective_gbps": round(weight_bytes / total_s / 1e9, 3)}), flush=True)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
