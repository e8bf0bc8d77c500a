"""How an engine instance is sized: KV-cache pool, batch limits, device. Validated up front."""

from __future__ import annotations

from dataclasses import dataclass

from worker.models.model_config import DTYPES

MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    # Tokens per KV block. 16 matches the Triton kernels' tile and keeps waste per sequence small.
    block_size: int = 16
    # KV pool size: an explicit block count wins; otherwise as many blocks as fit in kv_cache_bytes.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 512 * MiB
    max_num_seqs: int = 64
    # Per-step token budget shared by prefill chunks and decodes.
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Automatic prefix caching (vLLM v1's default): full KV blocks are named by their prefix and
    # shared, so a prompt that starts like an earlier one (a system prompt, a chat's history, the
    # other choices of an n > 1 request) computes only its new tail (`worker.kv.block_manager`).
    enable_prefix_caching: bool = True
    # Longest prompt + output; None means the model's max_position_embeddings.
    max_model_len: int | None = None
    # Weights and KV dtype; None means the checkpoint's.
    dtype: str | None = None
    device: str = "cpu"
    # Force an attention backend by name ("reference"); None picks by device.
    attention_backend: str | None = None
    # float32 and bfloat16 on CPU: hold linear weights pre-packed for oneDNN (kernels/cpu_linear.py),
    # 1.2-2.3x faster GEMMs at decode batch sizes; float32 also keeps the plain copy for 1-2-row
    # steps (twice the host memory), bfloat16 releases it. False: plain weights only.
    cpu_weight_prepack: bool = True
    # Packing costs ~0.6 s per GB of linear weights on a 2-core VM: a model whose linear weights are
    # larger than this starts serving on the plain weights and is packed a layer at a time while
    # nothing waits for it (`worker.models.weight_packing`), so no cold start pays for it. None: always at load.
    cpu_prepack_defer_bytes: int | None = 64 * MiB
    # Weights that arrive while the engine runs (`Engine(..., weights=source)`): how long one layer
    # may take to arrive before the engine gives up on its source and fails the requests waiting.
    layer_timeout_s: float = 600.0
    # While weights arrive: run each queued prefill as its own sub-batch, layer by layer as layers
    # land, oldest first, a prefill at the last resident layer yielding to the next (BlitzScale's
    # zigzag, `worker.engine.zigzag_prefill`). False: each step's one batch blocks at every missing layer.
    zigzag_prefill: bool = True
    # On CUDA: replay decode-only steps of up to min(max_num_seqs, 256) sequences from captured CUDA
    # graphs (`worker.engine.decode_graphs`), each batch size captured on first use. False: always eager.
    cuda_graphs: bool = True
    # Structured output: compute the grammar masks of a step's structured requests on a helper thread
    # while its forward pass runs (`worker.engine.structured_output_manager`). False: inline, before it.
    overlap_structured_output: bool = True
    # Sleep (`Engine.sleep`) also moves the weights into host memory (pinned on CUDA) and frees their
    # device copy; waking copies them back (`worker.loading.host_weights`). None: on a CUDA device yes (its
    # memory is what another model needs), on a CPU no (the weights are in host memory already).
    sleep_offloads_weights: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        defer = self.cpu_prepack_defer_bytes
        if defer is not None and (not isinstance(defer, int) or isinstance(defer, bool) or defer < 0):
            raise ValueError(f"cpu_prepack_defer_bytes must be a number of bytes >= 0 or None, got {defer!r}")
        if isinstance(self.layer_timeout_s, bool) or not isinstance(self.layer_timeout_s, (int, float)) \
                or not self.layer_timeout_s > 0:
            raise ValueError(f"layer_timeout_s must be a positive number of seconds, got {self.layer_timeout_s!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {self.dtype!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.sleep_offloads_weights is not None and not isinstance(self.sleep_offloads_weights, bool):
            raise ValueError(f"sleep_offloads_weights must be true, false or None (by device), "
                             f"got {self.sleep_offloads_weights!r}")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
