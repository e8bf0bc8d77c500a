"""Random-weight Llama checkpoints of real sizes, written fast and put into a local repository.

`write_random_llama` writes a Hugging Face model dir for any `worker.DemoModelConfig` shape
(Llama-3-8B's 16 GB as easily as a test's few kB): config and tokenizer come from the demo model
(`worker.write_demo_model` of a one-layer clone, its config's shape fields then set to the real
ones), the weights are streamed straight into one ``model.safetensors`` -- header, then each
tensor's bytes written from one random block of at most `BLOCK_ELEMENTS` values (drawn once per
checkpoint from the seed, N(0, init_std) in the config's dtype), tiled from a per-tensor offset so
tensors differ; norm weights are ones. Nothing holds more than that block in memory, and the
write runs at the file system's copy rate (drawing 8B normal values would take longer than
writing them). The weights are meaningless, as a random model's are; their shapes, dtype and
bytes are exactly the real model's, which is what a load, a sleep or a wake costs.

`publish_random_llama` makes such a checkpoint a model of a local repository (the form
``thaw serve --repository DIR`` deploys from without a copy: a source ``DIR/<name>``): written
next to the repository, converted to the thaw format (`loader.convert_checkpoint`), pushed, and
the scratch copies deleted, so the peak is twice the model. A model already in the repository is
reused (written once per work dir; `is_published` tells). `weight_shapes` / `num_weight_bytes`
give a shape's tensors and bytes without writing anything (a dry run's arithmetic).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
from pathlib import Path

from worker.models.demo_model import DemoModelConfig, demo_weight_shapes, write_demo_model

BLOCK_ELEMENTS = 1 << 24  # 32 MiB of bf16: the random values every tensor is tiled from
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_TOKENIZER_CLONE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128)
# The shape fields of config.json that the one-layer clone's values are replaced with.
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")


def weight_shapes(config: DemoModelConfig) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names -> shapes for `config` (its ``vocab_size`` must be set)."""
    if config.vocab_size is None:
        raise ValueError("a random Llama needs DemoModelConfig.vocab_size set (the tokenizer's size is not known "
                         "before it is built)")
    return demo_weight_shapes(config, config.vocab_size)


def num_weight_bytes(config: DemoModelConfig) -> int:
    """The weights' bytes in the config's dtype (what a safetensors file holds, header aside)."""
    return sum(math.prod(shape) for shape in weight_shapes(config).values()) * _item_bytes(config)


def _item_bytes(config: DemoModelConfig) -> int:
    if config.dtype not in _ITEM_BYTES:
        raise ValueError(f"a random Llama is written in one of {sorted(_ITEM_BYTES)}, got {config.dtype!r}")
    return _ITEM_BYTES[config.dtype]


def random_block(config: DemoModelConfig, num_elements: int) -> bytes:
    """The random values tensors are tiled from: `num_elements` draws of N(0, init_std) from the
    config's seed, in its dtype, as little-endian bytes."""
    import torch

    generator = torch.Generator().manual_seed(config.seed)
    block = torch.empty(num_elements, dtype=torch.float32).normal_(0.0, config.init_std, generator=generator)
    return block.to(getattr(torch, config.dtype)).view(torch.uint8).numpy().tobytes()


def tile_offset(tensor_index: int, block_elements: int) -> int:
    """Where in the block (in elements) tensor number `tensor_index` starts its tiling."""
    return (tensor_index * 2654435761) % block_elements  # Knuth's multiplicative hash: spread, fixed


def _ones(config: DemoModelConfig, numel: int) -> bytes:
    import torch

    return torch.ones(numel, dtype=getattr(torch, config.dtype)).view(torch.uint8).numpy().tobytes()


def write_random_safetensors(path: Path, config: DemoModelConfig) -> int:
    """One safetensors file with every weight of `config` (see the module docstring); returns
    the weights' bytes. Norm weights are ones, every other tensor tiled from `random_block`."""
    shapes = weight_shapes(config)
    item = _item_bytes(config)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * item
        header[name] = {"dtype": _SAFETENSORS_DTYPES[config.dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-aligned, as safetensors writes it
    block_elements = min(BLOCK_ELEMENTS, max(math.prod(s) for s in shapes.values()))
    block = memoryview(random_block(config, block_elements))
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if name.endswith("norm.weight"):
                out.write(_ones(config, numel))
                continue
            start, left = tile_offset(index, block_elements) * item, numel * item
            while left:
                piece = block[start:start + left]
                out.write(piece)
                left -= len(piece)
                start = 0
    return offset


def write_random_llama(out_dir: Path, config: DemoModelConfig) -> Path:
    """A Hugging Face Llama dir of `config`'s shape with random weights; returns `out_dir`
    (replaced if it exists)."""
    clone = dataclasses.replace(config, **_TOKENIZER_CLONE, vocab_size=None, tie_word_embeddings=False)
    write_demo_model(out_dir, clone, overwrite=True)
    (out_dir / "model.safetensors").unlink()
    model_config = json.loads((out_dir / "config.json").read_text())
    model_config.update({name: getattr(config, name) for name in _SHAPE_FIELDS}, vocab_size=config.vocab_size,
                        head_dim=config.head_dim, initializer_range=config.init_std)
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    write_random_safetensors(out_dir / "model.safetensors", config)
    return out_dir


def is_published(repository: Path, name: str) -> bool:
    """Whether the local repository at `repository` holds a complete model `name`."""
    from storage import LocalModelRepository

    repo = LocalModelRepository(repository)
    return repo.root.is_dir() and repo.exists(name)


def publish_random_llama(repository: Path, name: str, config: DemoModelConfig) -> tuple[int, bool]:
    """`name` in the local repository at `repository`, written if absent (see the module
    docstring); returns (its bytes as the repository counts them, whether it was already there)."""
    from loader import convert_checkpoint
    from storage import LocalModelRepository

    repo = LocalModelRepository(repository)
    if is_published(repository, name):
        return repo.describe(name).total_bytes, True
    scratch = repo.root.parent / f".{name}.scratch"  # the repository's file system: no cross-device copy
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        hf_dir = write_random_llama(scratch / "hf", config)
        convert_checkpoint(hf_dir, scratch / "thaw", progress=False)
        shutil.rmtree(hf_dir)  # before the push's copy: at most two copies of the model at once
        manifest = repo.push(scratch / "thaw", name, overwrite=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest.total_bytes, False
