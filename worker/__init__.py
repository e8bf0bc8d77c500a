"""The inference worker: a paged-KV, continuous-batching engine for Llama-family models.

Public API (everything else in this folder is private to it):
- `Engine`, `EngineConfig`: load a Hugging Face model dir; ``add_request`` / ``step`` / ``abort``.
- `AsyncEngine`: ``async for out in AsyncEngine(engine).generate(prompt, params)``.
- `SamplingParams`, `RequestOutput`, `Completion`, `InvalidRequestError`.
- `ModelConfig`, `UnsupportedModelError`, `CheckpointError`: what a checkpoint is, and why it was refused.
- `Tokenizer`: tokenizer + chat template without `transformers`.
- `DemoModelConfig`, `write_demo_model`: a small Llama checkpoint built locally.
"""

from worker.async_engine import AsyncEngine, EngineDeadError
from worker.checkpoint import CheckpointError
from worker.demo_model import DemoModelConfig, write_demo_model
from worker.engine import Engine, InvalidRequestError
from worker.engine_config import EngineConfig
from worker.model_config import ModelConfig, UnsupportedModelError
from worker.request_output import Completion, RequestOutput
from worker.sampling_params import SamplingParams
from worker.tokenizer import Tokenizer

__all__ = [
    "AsyncEngine", "CheckpointError", "Completion", "DemoModelConfig", "Engine", "EngineConfig",
    "EngineDeadError", "InvalidRequestError", "ModelConfig", "RequestOutput", "SamplingParams", "Tokenizer",
    "UnsupportedModelError", "write_demo_model",
]
