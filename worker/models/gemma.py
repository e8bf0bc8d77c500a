"""The Gemma 2 and Gemma 3 text decoders (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``) over a paged KV cache.

Both are the Llama decoder (`llama.py`) with these differences, each as transformers 5's
``modeling_gemma2.py`` and ``modeling_gemma3.py`` compute it:

* the token embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the model's dtype first
  (in bfloat16 sqrt(3072) = 55.43 becomes 55.5);
* RMSNorm multiplies by ``1 + weight`` in float32 and casts after (Llama casts, then multiplies);
* four norms per layer: the attention and MLP outputs are normalised too
  (``post_attention_layernorm``, ``post_feedforward_layernorm``) before their residual add, and the
  MLP input by ``pre_feedforward_layernorm``;
* the MLP's gate goes through GELU (tanh approximation), not SiLU;
* scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
* sliding-window and full-attention layers (``layer_types``; Gemma 2 alternates them by default).

Gemma 2 also soft-caps, x -> ``cap * tanh(x / cap)``: every attention score after the scale and
before the causal/window mask (``attn_logit_softcapping``, passed to the attention backend, which
implements it in each kernel), and the final logits (``final_logit_softcapping``, on the head's
output in the model's dtype before the float32 cast, transformers' order). It has one RoPE setting
for every layer, so its `embed` is Llama's (any RoPE type Llama runs) times the embedding scale.

Gemma 3 (`Gemma3ForCausalLM`, a subclass) drops the soft-capping (configs that set it are refused
when read, `model_config.py`) and adds per-head q/k norms (the Gemma RMSNorm over ``head_dim``)
and two RoPE settings: sliding layers rotate with ``local_rope_theta`` and no scaling, full layers
with ``rope_theta`` and the config's scaling (linear x8 in the published models). That is why its
`embed` returns cos and sin stacked, ``[2, T, 1, D]`` (0 the local setting, 1 the global): the
runner, the layer gate and zigzag prefill only pass them from `embed` to `decoder_layer`, and each
layer picks its row. Everything else -- the forward pass split into `embed` / `decoder_layer` /
`final_norm` / `compute_logits`, the layer gate, CPU pre-packing -- is `LlamaForCausalLM`'s, inherited.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.llama import MLP, Attention, LlamaForCausalLM
from worker.models.model_config import ModelConfig, RopeScaling
from worker.models.rotary_embedding import attention_factor, inverse_frequencies, rope_cos_sin

LOCAL_ROPE, GLOBAL_ROPE = 0, 1  # rows of Gemma 3's stacked cos and sin


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, all in float32, cast back at the end (transformers' order)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., H]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(Attention):
    """Llama's paged attention with Gemma's score scale, Gemma 2's score cap and Gemma 3's q/k norms."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.softcap = config.attn_logit_softcapping  # None for Gemma 3
        if config.qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        # Gemma 3: the row of embed's stacked cos/sin this layer rotates with; Gemma 2: one setting, no rows.
        self.rope: int | None = None
        if config.family == "gemma3":
            self.rope = LOCAL_ROPE if config.sliding_windows[layer_idx] is not None else GLOBAL_ROPE

    def forward(self, x, cos, sin, kv_cache, metadata, backend):  # x: [T, H]; cos, sin: [T, 1, D] or [2, T, 1, D]
        if self.rope is not None:
            cos, sin = cos[self.rope], sin[self.rope]
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata, backend)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2's modules under `LlamaForCausalLM`'s forward pass (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        # Not LlamaForCausalLM.__init__: its layers are Llama's. The same attribute names, so the
        # inherited methods and the checkpoint's parameter names apply.
        nn.Module.__init__(self)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # transformers keeps sqrt(hidden_size) as a float32 tensor and casts it to the weights' dtype.
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, device="cpu").to(config.torch_dtype))
        self.final_logit_softcapping = config.final_logit_softcapping  # None for Gemma 3
        self.register_buffer("inv_freq", inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling),
                             persistent=False)  # [D/2]; longrope: [2, D/2]
        self.rope_attention_factor = attention_factor(config.rope_scaling)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T], [T] int64
              rope_lengths: torch.Tensor | None = None,  # [T] int64, see LlamaForCausalLM.embed
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # x: [T, H]; cos, sin: [T, 1, D]
        x, cos, sin = super().embed(input_ids, positions, rope_lengths)
        return x * self.embed_scale, cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        logits = self.vocab_logits(hidden)  # [N, V] in the model's dtype, where transformers caps them
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model with Gemma 3's q/k norms (made by `GemmaAttention`) and two RoPE settings."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)  # rope_attention_factor: the global setting's (yarn)
        local = inverse_frequencies(config.head_dim, config.local_rope_theta, RopeScaling())
        self.inv_freq = torch.stack((local, self.inv_freq))  # [2, D/2]: the local setting, then the global one

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T], [T] int64
              rope_lengths: torch.Tensor | None = None,  # unused: longrope is refused for Gemma 3
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # x: [T, H]; cos, sin: [2, T, 1, D]
        x = self.embed_tokens(input_ids) * self.embed_scale  # [T, H]
        local_cos, local_sin = rope_cos_sin(positions, self.inv_freq[LOCAL_ROPE], x.dtype)
        cos, sin = rope_cos_sin(positions, self.inv_freq[GLOBAL_ROPE], x.dtype, self.rope_attention_factor)
        return x, torch.stack((local_cos, cos)), torch.stack((local_sin, sin))
