"""Reads a checkpoint into the model `model_family.build_model` picks (`LlamaForCausalLM`, or Gemma 2's and
Gemma 3's subclasses): the thaw format (through `loader`'s parallel,
checksummed loader) or a Hugging Face safetensors dir.

Hugging Face dirs: a single ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Tensor names are mapped onto our fused layout (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``; Phi-3 checkpoints store both fused already, in the same row order); every
expected tensor must be present with the expected shape and every
tensor in the files must be used, so a truncated or foreign checkpoint is refused with the
name of what is wrong instead of producing a silently wrong model. Both formats carry the
same Hugging Face tensor names, so the mapping below serves both.

Mixture-of-experts layers (`worker.models.moe`) take their experts stacked, ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I]. Checkpoints come in two layouts, and both load: one tensor per expert and
projection, as published on the Hub and as transformers 5 still saves by default
(``block_sparse_moe.experts.{e}.w1/w3/w2`` for Mixtral, ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
for Qwen3-MoE), and the stacked ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` (+
``mlp.gate.weight``) of transformers 5's ``save_pretrained(save_original_format=False)``. The per-expert
names are the ones checked; a stacked checkpoint is first split into views under those names. Either
way the experts are copied once into the stacked parameters.

`layer_state_dict` does the same for one layer at a time, for weights that arrive layer by layer
(`worker.loading.layer_gate`); `to_engine_state_dict` is built from the same per-layer function, so the
two paths cannot disagree about a name.

On a CUDA device a thaw checkpoint is read straight into GPU memory (`loader.DeviceLoader`: pinned
staging buffers and asynchronous copies, or DMA from the DRAM tier's pages), never through a host
copy of the whole model; Hugging Face dirs and every CPU load take the host path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from loader import (CudaCopyEngine, HostMemoryPool, contained_path, is_thaw_checkpoint, load_checkpoint, load_to_device,
                    shard_paths)
from worker.models.llama import LlamaForCausalLM
from worker.models.model_family import build_model
from worker.models.model_config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that we recompute.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Gemma 2's and 3's norms around the MLP, in addition to Llama's two per layer.
_GEMMA_FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# transformers 5's own MoE layout (see the module docstring): the experts of a layer in one tensor each.
_STACKED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)")


class CheckpointError(ValueError):
    """The checkpoint on disk is incomplete or does not match its config."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model dir, from its index when sharded."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {exc}") from exc
        files = shard_paths(model_dir, weight_map)  # refuses entries (and symlinks) leading outside model_dir
    elif (model_dir / SINGLE_FILE).is_file():
        files = [contained_path(model_dir, SINGLE_FILE, "the weights file")]
    else:
        raise FileNotFoundError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard(s) listed in {INDEX_FILE} are missing: {', '.join(missing)}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error type for bad headers
            raise CheckpointError(f"cannot read {path}: {exc}") from exc


def expected_layer_shapes(layer: int, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for one layer of a checkpoint of this config, layers numbered
    as in `loader.LayerReadiness`: -1 the embedding, 0..N-1 the decoder layers, N the final norm and
    (unless tied to the embedding) the head."""
    h, i, d, n = config.hidden_size, config.intermediate_size, config.head_dim, config.num_hidden_layers
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    if layer == -1:
        return {"model.embed_tokens.weight": (config.vocab_size, h)}
    if layer == n:
        shapes: dict[str, tuple[int, ...]] = {"model.norm.weight": (h,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
        return shapes
    if not 0 <= layer < n:
        raise ValueError(f"layer {layer} does not exist: layers run from -1 (embedding) to {n} (final norm and head)")
    p = f"model.layers.{layer}."
    if config.family == "phi3":  # stored fused, in our order: q/k/v rows, then gate/up rows
        return {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_up_proj.weight": (2 * i, h), p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes = {
        p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
    }
    if config.moe_layers[layer]:
        router, experts = _expert_names(layer, config)
        m = config.moe_intermediate_size
        shapes[router] = (config.num_experts, h)
        for gate, up, down in experts:
            shapes |= {gate: (m, h), up: (m, h), down: (h, m)}
    else:
        shapes |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    if config.attention_bias:
        shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if config.qk_norm:  # Qwen3 (like Llama) biases o_proj too when attention_bias is set
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    if config.qk_norm:
        shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if config.is_gemma:
        shapes |= {p + name + ".weight": (h,) for name in _GEMMA_FEEDFORWARD_NORMS}
    return shapes


def _expert_names(layer: int, config: ModelConfig) -> tuple[str, list[tuple[str, str, str]]]:
    """A sparse layer's router name and each expert's (gate, up, down) names, as published on the Hub."""
    if config.family == "mixtral":
        moe = f"model.layers.{layer}.block_sparse_moe."
        projections = ("w1", "w3", "w2")
    else:
        moe = f"model.layers.{layer}.mlp."
        projections = ("gate_proj", "up_proj", "down_proj")
    experts = [tuple(f"{moe}experts.{e}.{w}.weight" for w in projections) for e in range(config.num_experts)]
    return moe + "gate.weight", experts


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for a whole checkpoint of this config."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(-1, config.num_hidden_layers + 1):
        shapes |= expected_layer_shapes(layer, config)
    return shapes


def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along dim 0 -- as a view, without copying, when the parts already lie
    back to back in one buffer (the thaw converter writes fused projections that way, and the
    loader hands out views of one host buffer); a copy otherwise."""
    first = parts[0]
    adjacent = all(
        p.is_contiguous() and p.dtype == first.dtype and p.device == first.device and p.shape[1:] == first.shape[1:]
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts
    ) and all(a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(parts, parts[1:]))
    if not adjacent:
        return torch.cat(parts)
    num_rows = sum(p.shape[0] for p in parts)
    return first.as_strided((num_rows, *first.shape[1:]), first.stride(), first.storage_offset())


def to_engine_state_dict(hf_tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Renames and fuses Hugging Face tensors into `LlamaForCausalLM`'s parameter names."""
    tensors = _usable_tensors(hf_tensors, config)
    _check_tensors(tensors, expected_shapes(config), "checkpoint")
    state: dict[str, torch.Tensor] = {}
    for layer in range(-1, config.num_hidden_layers + 1):
        state |= _fuse_layer(layer, tensors, config)
    return state


def layer_state_dict(layer: int, hf_tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """`to_engine_state_dict` for one layer (-1 embedding, 0..N-1 decoder layers, N final norm and
    head): `hf_tensors` are that layer's tensors as `loader.LayerReadiness.wait_layer` hands them out,
    exactly those and no others; the result uses the model's full parameter names
    (``layers.3.self_attn.qkv_proj.weight``). A tied head is no parameter of layer N: the head is
    the embedding (layer -1)."""
    tensors = _usable_tensors(hf_tensors, config)
    _check_tensors(tensors, expected_layer_shapes(layer, config), f"layer {layer} of the checkpoint")
    return _fuse_layer(layer, tensors, config)


def _usable_tensors(hf_tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = {k: v for k, v in hf_tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied copy too
    if config.num_experts:
        tensors = _split_stacked_experts(tensors, config)
    return tensors


def _split_stacked_experts(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Renames transformers 5's stacked expert tensors to the per-expert Hub names (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    e, h, m = config.num_experts, config.hidden_size, config.moe_intermediate_size
    for name, tensor in tensors.items():
        match = _STACKED_EXPERTS.fullmatch(name)
        layer = int(match.group(1)) if match else -1
        if match is None or not 0 <= layer < config.num_hidden_layers or not config.moe_layers[layer]:
            out[name] = tensor
            continue
        router, experts = _expert_names(layer, config)
        kind = match.group(2)
        want = {"gate.weight": (e, h), "experts.gate_up_proj": (e, 2 * m, h), "experts.down_proj": (e, h, m)}[kind]
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, config implies {want}")
        if kind == "gate.weight":
            out[router] = tensor
        elif kind == "experts.gate_up_proj":
            for k, (gate, up, _) in enumerate(experts):
                out[gate], out[up] = tensor[k, :m], tensor[k, m:]
        else:
            for k, (_, _, down) in enumerate(experts):
                out[down] = tensor[k]
    return out


def _check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], what: str) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{what} lacks tensor(s) {', '.join(missing[:5])}{more}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{what} has tensor(s) this architecture does not use: {', '.join(unexpected[:5])}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensors[name].shape)}, config implies {shape}")


def _fuse_layer(layer: int, tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """One layer's engine parameters from checked Hugging Face tensors (the only renaming code)."""
    dtype = config.torch_dtype

    def t(name: str) -> torch.Tensor:
        return tensors[name].to(dtype)  # no copy when the dtype already matches: fused views stay views

    if layer == -1:
        return {"embed_tokens.weight": t("model.embed_tokens.weight")}
    if layer == config.num_hidden_layers:
        state = {"norm.weight": t("model.norm.weight")}
        if not config.tie_word_embeddings:
            state["lm_head.weight"] = t("lm_head.weight")
        return state
    src, dst = f"model.layers.{layer}.", f"layers.{layer}."
    if config.family == "phi3":  # already fused as the engine fuses them: only the prefix changes
        return {dst + name: t(src + name) for name in (
            "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
            "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}
    attn = src + "self_attn."
    state = {dst + "self_attn.qkv_proj.weight": concat_rows([t(attn + x + "_proj.weight") for x in "qkv"])}
    if config.attention_bias:
        state[dst + "self_attn.qkv_proj.bias"] = concat_rows([t(attn + x + "_proj.bias") for x in "qkv"])
    state[dst + "self_attn.o_proj.weight"] = t(attn + "o_proj.weight")
    if config.attention_bias and config.qk_norm:
        state[dst + "self_attn.o_proj.bias"] = t(attn + "o_proj.bias")
    if config.qk_norm:
        state[dst + "self_attn.q_norm.weight"] = t(attn + "q_norm.weight")
        state[dst + "self_attn.k_norm.weight"] = t(attn + "k_norm.weight")
    if config.moe_layers[layer]:
        state |= _stack_experts(layer, tensors, config)
    else:
        state[dst + "mlp.gate_up_proj.weight"] = concat_rows([t(src + "mlp.gate_proj.weight"),
                                                              t(src + "mlp.up_proj.weight")])
        state[dst + "mlp.down_proj.weight"] = t(src + "mlp.down_proj.weight")
    state[dst + "input_layernorm.weight"] = t(src + "input_layernorm.weight")
    state[dst + "post_attention_layernorm.weight"] = t(src + "post_attention_layernorm.weight")
    if config.is_gemma:
        state |= {dst + name + ".weight": t(src + name + ".weight") for name in _GEMMA_FEEDFORWARD_NORMS}
    return state


def _stack_experts(layer: int, tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A sparse layer's `moe.SparseMoeBlock` parameters: the router, and each expert's projections
    copied (and cast) once into the stacked [E, 2I, H] and [E, H, I] tensors."""
    router, experts = _expert_names(layer, config)
    m, dtype = config.moe_intermediate_size, config.torch_dtype
    first = tensors[experts[0][0]]
    gate_up = torch.empty(config.num_experts, 2 * m, config.hidden_size, dtype=dtype, device=first.device)
    down = torch.empty(config.num_experts, config.hidden_size, m, dtype=dtype, device=first.device)
    for k, (gate, up, down_name) in enumerate(experts):
        gate_up[k, :m].copy_(tensors[gate])
        gate_up[k, m:].copy_(tensors[up])
        down[k].copy_(tensors[down_name])
    dst = f"layers.{layer}.mlp."
    return {dst + "router_weight": tensors[router].to(dtype), dst + "gate_up_proj": gate_up, dst + "down_proj": down}


def read_checkpoint(model_dir: str | Path, pool: HostMemoryPool | None = None
                    ) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a checkpoint by Hugging Face name, and a one-line account of the read.
    A thaw checkpoint is read into a buffer from `pool` when given (a pre-faulted one is faster)."""
    if is_thaw_checkpoint(model_dir):
        tensors, stats = load_checkpoint(model_dir, pool=pool)
        how_read = ("mapped from memory, no copy" if stats.mapped else "O_DIRECT" if stats.direct_io else "buffered")
        checksums = "not verified" if not stats.verified else "verified" if not stats.num_trusted_bytes else (
            f"verified; {stats.num_trusted_bytes / 1e9:.2f} GB at an earlier load, unchanged since")
        how = (f"thaw format: {stats.total_bytes / 1e9:.2f} GB in {stats.elapsed_s:.2f} s "
               f"({stats.gb_per_s:.2f} GB/s, {how_read}, {stats.num_threads} threads, checksums {checksums})")
        return tensors, how
    files = checkpoint_files(model_dir)
    return dict(iter_safetensors(files)), f"safetensors: {len(files)} file(s)"


def read_checkpoint_to_device(model_dir: str | Path, device: torch.device | str) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a thaw checkpoint, read straight into CUDA `device`'s memory, and a one-line
    account of the read."""
    tensors, stats = load_to_device(model_dir, CudaCopyEngine(device))
    checksums = "not verified" if not stats.verified else "verified" if not stats.num_trusted_bytes else (
        f"verified; {stats.num_trusted_bytes / 1e9:.2f} GB at an earlier load, unchanged since")
    how = (f"thaw format to {stats.device}: {stats.total_bytes / 1e9:.2f} GB in {stats.elapsed_s:.2f} s "
           f"({stats.gb_per_s:.2f} GB/s, {stats.source_kind}, {stats.num_threads} threads, checksums {checksums})")
    return tensors, how


def load_model(model_dir: str | Path, config: ModelConfig, device: torch.device | str = "cpu",
               pool: HostMemoryPool | None = None) -> tuple[LlamaForCausalLM, str]:
    """Builds the model on the meta device and assigns the checkpoint's weights to it.
    Returns the model and how its weights were read (for the startup log)."""
    if torch.device(device).type == "cuda" and is_thaw_checkpoint(model_dir):
        hf_tensors, how = read_checkpoint_to_device(model_dir, device)
    else:
        hf_tensors, how = read_checkpoint(model_dir, pool)
    state = to_engine_state_dict(hf_tensors, config)
    with torch.device("meta"):
        model = build_model(config)
    model.load_state_dict(state, assign=True, strict=True)
    return model.to(device).eval().requires_grad_(False), how
