"""A model's own sampling defaults, from its ``generation_config.json``.

Model authors ship recommended sampling settings there (Qwen3: temperature 0.6, top_p 0.95,
top_k 20; Llama 3.1 instruct: temperature 0.6, top_p 0.9). vLLM applies them by default to the
fields a request leaves out, so users moving from vLLM get the same outputs; so does Thaw: the
gateway marks the left-out fields (`wire.SamplingParams.model_defaults`) and the engine fills them
from here. Only the fields in `wire.MODEL_DEFAULT_FIELDS` are read; a value the sampler would
refuse is skipped with a warning rather than failing every request of the model.

The same file names the model's end-of-sequence ids, read by `read_eos_ids` as transformers does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from wire import MODEL_DEFAULT_FIELDS, SamplingParams

if TYPE_CHECKING:
    from worker.models.model_config import ModelConfig
    from worker.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"


def read_generation_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling defaults `model_dir`'s generation_config.json sets ({} without one)."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("%s is unreadable (%s); the model's sampling defaults are not used", path, exc)
        return {}
    if not isinstance(raw, dict):
        return {}
    defaults: dict[str, float | int] = {}
    for name in MODEL_DEFAULT_FIELDS:
        if name not in raw or raw[name] is None:
            continue
        try:
            SamplingParams(**{name: raw[name]})  # the sampler's own checks
        except ValueError as exc:
            logger.warning("%s: %s; this default is not used", path, exc)
            continue
        defaults[name] = raw[name]
    return defaults


def read_eos_ids(model_dir: Path, config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids the way `transformers.generate` picks them: generation_config.json
    first, then config.json, then the tokenizer's."""
    path = model_dir / "generation_config.json"
    if path.is_file():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
    if config.eos_token_ids:
        return config.eos_token_ids
    return tuple(tokenizer.eos_token_ids)
