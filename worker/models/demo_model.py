"""A small, randomly initialised Llama checkpoint built locally, for tests, demos and benchmarks.

Nothing is downloaded: `build_tokenizer` trains a byte-level BPE tokenizer (Llama 3's special
tokens and chat format) on a built-in corpus, and `write_demo_model` writes a complete Hugging
Face Llama dir around it: config.json, generation_config.json, model.safetensors and the
tokenizer files. The dir loads with `transformers.AutoModelForCausalLM` / `AutoTokenizer`
(which the tests check) and with our own loader and `Tokenizer`, so the engine is exercised on
exactly the file formats it will meet for real models.

Weights come from one `torch.Generator` seeded with `config.seed`, drawn tensor by tensor in a
fixed order straight into their final buffers (no module is built and then overwritten), so
the same config gives a bit-identical model.safetensors and a ~100M-parameter model is written
in seconds. Only plain torch + safetensors are used; `transformers` is a test dependency.

The dir is written into a temporary sibling and moved into place with `os.replace`, so an
interrupted write never leaves a dir that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "EOT_TOKEN",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "DemoModelConfig",
    "build_tokenizer",
    "write_demo_model",
    "demo_weight_shapes",
]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN)

# Meta's Llama 3 instruct template: BOS, then per message a role header and the trimmed content
# closed by <|eot_id|>; the generation prompt opens an assistant header.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A serving engine turns prompts into tokens and tokens into text.",
    "Paged attention stores the key and value cache in fixed-size blocks.",
    "The scheduler decides which requests run in the next step.",
    "Every request has a prompt, a number of computed tokens and a budget.",
    "Once upon a time there was a small model that wanted to be fast.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "It was the best of times, it was the worst of times.",
    "To be, or not to be, that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
    "The weather today is sunny with a light breeze from the west.",
    "Please summarise the following paragraph in one sentence.",
    "You are a helpful assistant. Answer the question briefly.",
    "What is the capital of France? The capital of France is Paris.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The train leaves at nine o'clock and arrives at noon.",
    "Numbers like 1, 2, 3, 42, 1000 and 3.14159 appear in text too.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    'The JSON object was {"name": "thaw", "version": 1, "ok": true}.',
    "Snapshots let a cold worker thaw quickly and start serving again.",
    "Weights are loaded from safetensors files straight into memory.",
    "The controller reconciles the desired state with the observed state.",
    "Streaming responses send text as soon as it is ready.",
    "Stop sequences end a completion before the model says too much.",
    "I can't believe it's already Friday! Isn't that great?",
    "They're going to the market; we'll meet them there later.",
    "An apple a day keeps the doctor away, or so they say.",
    "Mountains, rivers, forests and deserts cover the continents.",
    "The library opens at eight in the morning and closes at six.",
    "We drank a café au lait in a small café near the river.",
    "It would be naïve to think the coöperation was easy.",
    "Crème brûlée and jalapeño poppers were on the menu.",
    "日本語のテキストも少し含まれています。",
    "東京は日本の首都です。",
    "Привет, мир! Как дела?",
    "Emoji are text too: 😀 🎉 🚀 ❤️ 👍🏽",
    "The résumé listed Zürich, São Paulo and Kraków.",
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> Path:
    """Trains the demo byte-level BPE tokenizer and writes tokenizer.json + tokenizer_config.json.

    Returns out_dir. `vocab_size` counts the special tokens; with the small built-in corpus the
    trainer may stop short of it, so read the real size from the written tokenizer.
    """
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise ValueError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size must be at least {min_size} (256 byte symbols + special tokens), got {vocab_size}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama 3: encode(add_special_tokens=True) starts with BOS.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    return out_dir


@dataclass(frozen=True)
class DemoModelConfig:
    """Shape and initialisation of the demo Llama; defaults give a ~3M-parameter model."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    intermediate_size: int = 688
    vocab_size: int | None = None  # None: the tokenizer's size; larger adds padding rows
    tokenizer_vocab_size: int = 1024  # what build_tokenizer is asked for
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    seed: int = 0
    dtype: str = "float32"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "tokenizer_vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DemoModelConfig.{name} must be a positive int, got {value!r}")
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool) or self.vocab_size <= 0
        ):
            raise ValueError(f"DemoModelConfig.vocab_size must be None or a positive int, got {self.vocab_size!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim (hidden_size / num_attention_heads = {self.head_dim}) must be even for RoPE")
        if self.dtype not in _DTYPES:
            raise ValueError(f"DemoModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("rope_theta", "rms_norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"DemoModelConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"DemoModelConfig.seed must be a non-negative int, got {self.seed!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"DemoModelConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def demo_weight_shapes(config: DemoModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """HF Llama weight names -> shapes, in the order they are drawn from the generator."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (h, h)  # [num_heads * head_dim, hidden]
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv, h)  # [num_kv_heads * head_dim, hidden]
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, h)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def _random_weights(config: DemoModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(config.seed)
    dtype = _DTYPES[config.dtype]
    weights = {}
    for name, shape in demo_weight_shapes(config, vocab_size).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
        else:
            # Drawn in float32 so every dtype sees the same random stream, then cast once.
            tensor = torch.empty(shape, dtype=torch.float32).normal_(0.0, config.init_std, generator=generator)
            weights[name] = tensor if dtype == torch.float32 else tensor.to(dtype)
    return weights


def _model_config_json(config: DemoModelConfig, vocab_size: int, bos_id: int, eos_ids: list[int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.rms_norm_eps,
        # transformers 5 reads rope_parameters; rope_theta stays for older readers (vLLM, transformers 4).
        "rope_theta": float(config.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_theta)},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "use_cache": True,
        # transformers 5 writes "dtype"; "torch_dtype" is what 4.x and most Hub configs carry.
        "dtype": config.dtype,
        "torch_dtype": config.dtype,
    }


def write_demo_model(
    out_dir: str | Path, config: DemoModelConfig = DemoModelConfig(), *, overwrite: bool = False
) -> Path:
    """Writes a complete Hugging Face Llama dir to out_dir and returns its path.

    Refuses a non-empty existing out_dir unless overwrite=True. The dir only appears once every
    file is written.
    """
    if not isinstance(config, DemoModelConfig):
        raise ValueError(f"config must be a DemoModelConfig, got {type(config).__name__}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ValueError(f"{out_dir} exists and is not a directory; choose another out_dir")
        if any(out_dir.iterdir()) and not overwrite:
            raise ValueError(f"{out_dir} is not empty; pass overwrite=True to replace it, or choose another out_dir")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build_tokenizer(tmp_dir, vocab_size=config.tokenizer_vocab_size)
        tokenizer = HFTokenizer.from_file(str(tmp_dir / "tokenizer.json"))
        tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab_size = tokenizer_size if config.vocab_size is None else config.vocab_size
        if vocab_size < tokenizer_size:
            raise ValueError(
                f"DemoModelConfig.vocab_size ({vocab_size}) is smaller than the tokenizer ({tokenizer_size} ids); "
                f"use None or at least {tokenizer_size}"
            )
        bos_id = tokenizer.token_to_id(BOS_TOKEN)
        eos_ids = [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(EOT_TOKEN)]

        _write_json(tmp_dir / "config.json", _model_config_json(config, vocab_size, bos_id, eos_ids))
        _write_json(
            tmp_dir / "generation_config.json",
            {"bos_token_id": bos_id, "eos_token_id": eos_ids},
        )
        save_file(_random_weights(config, vocab_size), str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp_dir, 0o755)  # mkdtemp makes it 0o700

        if out_dir.exists():
            # os.replace cannot replace a non-empty dir: move the old one aside first, drop it after.
            old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old_dir / "old")
            os.replace(tmp_dir, out_dir)
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
