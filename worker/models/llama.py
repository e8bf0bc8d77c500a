"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, and the mixture-of-experts Mixtral and
Qwen3-MoE, whose sparse layers put `moe.SparseMoeBlock` where the MLP is) over a paged KV cache.

The model takes one ragged step of tokens (the scheduler mixes prefill chunks and decode
tokens freely), so every tensor is ``[T, ...]`` with T the step's total new tokens; the
`AttentionMetadata` says which rows belong to which sequence. Q/K/V and gate/up projections
are fused into one matmul each (weights concatenated at load time, see `checkpoint.py`):
the same arithmetic per output as separate projections, with fewer, larger GEMMs.
Modules are created on the ``meta`` device and their weights assigned (gpt-fast's habit),
so a model is never initialised only to be overwritten.

The model is its pieces (`embed`, `decoder_layer`, `final_norm`, `compute_logits`); the runner
executes them (`worker.engine.model_runner.ModelRunner`), a whole step or a layer at a time, and
it is the runner that waits for a layer whose weights are still arriving (BlitzScale's layer-wise
start): the model knows nothing of where its weights are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionBackend, AttentionMetadata
from kernels.cpu_fused_ops import fused_add_rms_norm, fused_rms_norm, fused_silu_and_mul
from kernels.cpu_linear import PrepackedLinear, prepack_linear_layers
from loader.page_release import release_pages
from worker.models.model_config import ModelConfig
from worker.models.moe import SparseMoeBlock
from worker.models.rotary_embedding import (
    apply_rope,
    attention_factor,
    inverse_frequencies,
    per_token_inverse_frequencies,
    rope_cos_sin,
)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly as Hugging Face's Llama does. On CPU in
    float32/bfloat16 one fused op does it (`kernels.cpu_fused_ops`: the same arithmetic, one
    dispatch instead of eight); the PyTorch code below is the definition and the fallback."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] (or [T, Hq, D] for q/k norms)
        fused = fused_rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a residual add and this norm, fused where the op applies."""
        fused = fused_add_rms_norm(x, delta, self.weight, self.eps)  # [T, H] each
        if fused is not None:
            return fused
        x = x + delta
        return x, self(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Qwen3 biases o_proj with attention_bias; Qwen2's bias covers q/k/v only.
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias and config.qk_norm)
        # Qwen3: each head's query and key are RMS-normalised (one [D] weight each) before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.softcap: float | None = None  # scores capped at +-softcap: Gemma 2 sets it (`gemma.py`)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)  # [T, Hq, D]
        k = apply_rope(k, cos, sin)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        key_cache, value_cache = kv_cache
        backend.write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = backend.paged_attention(q, key_cache, value_cache, metadata, self.scale, self.sliding_window,
                                      self.softcap, key=k, value=v)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        fused = fused_silu_and_mul(gate_up)  # [T, I]: one op where it applies (`kernels.cpu_fused_ops`)
        if fused is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            fused = F.silu(gate) * up
        return self.down_proj(fused)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config) if config.moe_layers[layer_idx] else MLP(config)

    def forward(self, x, cos, sin, kv_cache, metadata, backend):  # x: [T, H]
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata, backend)
        x, normed = self.post_attention_layernorm.add_and_norm(x, attended)
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head, as pieces the runner executes (see the module docstring);
    ``compute_logits`` projects only the rows that will be sampled (one per sequence that finished
    its prefill or decodes), which is most of the saving on long prefills."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer(
            "inv_freq",  # [D/2]; longrope: [2, D/2], its short and long sets
            inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling),
            persistent=False,
        )
        self.rope_attention_factor = attention_factor(config.rope_scaling)  # yarn, longrope: scales cos and sin

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T], [T] int64
              rope_lengths: torch.Tensor | None = None,  # [T] int64
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # x: [T, H]; cos, sin: [T, 1, D]
        """`rope_lengths`: per token, max(its sequence's prompt length, position + 1), which picks
        longrope's frequency set as transformers does (see `rotary_embedding.py`); None means
        position + 1, exact for decode tokens. Only longrope reads it (`needs_rope_lengths`)."""
        x = self.embed_tokens(input_ids)  # [T, H]
        inv_freq = per_token_inverse_frequencies(self.inv_freq, self.config.rope_scaling, positions, rope_lengths)
        cos, sin = rope_cos_sin(positions, inv_freq, x.dtype, self.rope_attention_factor)  # [T, 1, D] each
        return x, cos, sin

    def decoder_layer(self, k: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
                      backend: AttentionBackend) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.layers[k](x, cos, sin, kv_cache, metadata, backend)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        return self.vocab_logits(hidden).float()

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] in the model's dtype
        """The head's output before `compute_logits` casts it (where Gemma 2 caps it, as transformers does)."""
        if self.lm_head is None:  # tied: the embedding matrix is the head
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def prepack_for_cpu(self, release_plain: bool = False) -> int:
        """Swaps every linear layer (and the head, tied or not) for a `PrepackedLinear`; returns
        how many. `release_plain`: see `prepack_layer_for_cpu`."""
        return sum(self.prepack_layer_for_cpu(layer, release_plain) for layer in range(-1, len(self.layers) + 1))

    def prepack_layer_for_cpu(self, layer: int, release_plain: bool = False) -> int:
        """`prepack_for_cpu` for one layer (its weights must be resident): the linears of decoder
        layer k (not a sparse layer's router and experts: see `moe.py`), the head for layer N,
        nothing for the embedding; returns how many. A tied head
        gets its own packed copy (so the embedding, layer -1, must be resident too): the embedding
        lookup needs the plain matrix, the head GEMM the blocked one.

        `release_plain`: each plain weight that no module reads any more (packed without a plain
        copy, and not the tied embedding) has its pages returned to the OS at once
        (`loader.release_pages`), so a model loaded as views of one checkpoint buffer is held
        once, not twice. Only for weights nothing else holds (the engine's own load)."""
        if layer == -1:
            return 0
        if layer < len(self.layers):
            block = self.layers[layer]
            plain = {name: m.weight for name, m in block.named_modules() if isinstance(m, nn.Linear)}
            replaced = prepack_linear_layers(block)
            if release_plain:
                for name, weight in plain.items():
                    packed = block.get_submodule(name)
                    if isinstance(packed, PrepackedLinear) and packed.plain_weight is None:
                        release_pages(weight)
            return replaced
        if isinstance(self.lm_head, PrepackedLinear):
            return 0
        tied = self.lm_head is None
        head_weight = self.embed_tokens.weight if tied else self.lm_head.weight
        self.lm_head = PrepackedLinear(head_weight)
        if release_plain and not tied and self.lm_head.plain_weight is None:
            release_pages(head_weight)
        return 1
