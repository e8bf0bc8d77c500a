"""Paying a worker process's one-time costs before it has a model: `warm_up_process`.

A spare worker (see `instance_worker_actor`) exists so that a cold start does not pay for a
process start. Importing torch is only the first of the one-time costs, though; the first model
a fresh process loads and runs also pays, on the request's path, for:

- building a module on the ``meta`` device, whose ``reset_parameters`` goes through
  ``torch._refs`` and imports ``torch._dynamo`` (~2 s here, measured: the bulk of a first load);
- loading the C++ CPU attention kernel and the tokenizer's jinja2 chat-template machinery;
- the thaw loader's thread pool and page-cache probe, the oneDNN primitives of the first
  bf16/fp32 matmuls, the sampler's first call.

`warm_up_process` pays them once, off any request's path: it writes a tiny random Llama (a few
hundred KB, with its tokenizer) to a temporary directory, converts it to the thaw format, loads it
into an `Engine` in each dtype asked for, runs one short greedy request, and deletes it all.
Nothing it builds outlives the call; what remains is the process's warmed state (imported
modules, loaded extension, initialised libraries).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

WARMUP_DTYPES = ("bfloat16", "float32")


# On a GPU: (hidden size, attention heads, KV heads) of tiny models whose heads are 64 and 128 wide
# with 4 query heads per KV head, the Triton kernels' commonest specialisations.
CUDA_WARMUP_SHAPES = ((256, 4, 1), (512, 4, 1))


def warm_up_process(dtypes: Iterable[str] = WARMUP_DTYPES, *, cuda: bool | None = None) -> float:
    """Loads and runs a tiny model once per dtype in this process; returns the seconds it took.
    With a GPU visible (``cuda=None`` asks torch), also on the GPU in bfloat16: that creates the
    CUDA context (about a second) and compiles the Triton kernels (seconds each; Triton's disk cache
    then serves every later process of the node), and the load to the GPU pins its staging
    buffers, all off the first request's path. Failures are logged and swallowed: a cold process is
    slower, never broken."""
    start = time.perf_counter()
    try:
        _warm_up(tuple(dtypes))
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        if cuda:
            _warm_up_cuda()
    except Exception:  # noqa: BLE001 - warm-up is an optimisation; the real load reports real errors
        logger.exception("worker process warm-up failed; the first load will pay its one-time costs")
    elapsed_s = time.perf_counter() - start
    logger.info("worker process warmed up in %.2f s", elapsed_s)
    return elapsed_s


def _warm_up(dtypes: tuple[str, ...]) -> None:
    from loader import convert_checkpoint
    from worker.models.demo_model import DemoModelConfig, write_demo_model
    from worker.engine.engine import Engine
    from worker.engine.engine_config import EngineConfig
    from wire.sampling_params import SamplingParams

    tiny = DemoModelConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, tokenizer_vocab_size=300, max_position_embeddings=128,
                           init_std=0.1, seed=0)
    with tempfile.TemporaryDirectory(prefix="thaw-warmup-") as tmp:
        hf_dir = write_demo_model(Path(tmp) / "hf", tiny)
        thaw_dir = Path(tmp) / "thaw"
        convert_checkpoint(hf_dir, thaw_dir, progress=False)
        for dtype in dtypes:
            engine = Engine(thaw_dir, EngineConfig(dtype=dtype, num_kv_blocks=8, block_size=16))
            engine.generate([[{"role": "user", "content": "hi"}]],
                            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def _warm_up_cuda() -> None:
    from loader import convert_checkpoint
    from worker.models.demo_model import DemoModelConfig, write_demo_model
    from worker.engine.engine import Engine
    from worker.engine.engine_config import EngineConfig
    from wire.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory(prefix="thaw-warmup-cuda-") as tmp:
        for hidden, heads, kv_heads in CUDA_WARMUP_SHAPES:
            tiny = DemoModelConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, intermediate_size=2 * hidden,
                                   tokenizer_vocab_size=300, max_position_embeddings=128, init_std=0.1, seed=0)
            hf_dir = write_demo_model(Path(tmp) / f"hf-{hidden}", tiny)
            thaw_dir = Path(tmp) / f"thaw-{hidden}"
            convert_checkpoint(hf_dir, thaw_dir, progress=False)
            engine = Engine(thaw_dir, EngineConfig(dtype="bfloat16", num_kv_blocks=8, block_size=16, device="cuda",
                                                   max_num_seqs=1))
            engine.generate([[{"role": "user", "content": "hi"}]],
                            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))

