"""The inference worker: a paged-KV, continuous-batching engine for Llama-family models.

Its modules live in subpackages that show the layers, bottom up (each imports only from the
layers below it; `tests/test_boundaries.py` checks it): `models` and `text`; `kv` and `loading`;
`engine`; `transfer` and `serving`. Each subpackage's docstring says what it holds. This module
is their public face, which other folders import.

Public API (what other folders import; of the rest, only the two migration modules named below,
and `worker.loading.host_allocator` for a process that runs one engine; bench/ measures internals directly):
- `Engine`, `EngineConfig`: load a Hugging Face model dir; ``add_request`` / ``step`` / ``abort``.
  ``Engine(model_dir, config, weights=source)`` starts before its weights (a `loader.LayerReadiness`)
  and computes layers as they land; `LayerLoadError` is how it fails when they cannot arrive.
  ``sleep`` / ``wake`` an idle engine: its KV pool freed, and where ``sleep_frees_weights`` (on a
  GPU) its weights moved to pinned host memory and back (``host_weights``: bytes and seconds).
- `AsyncEngine`: ``async for out in AsyncEngine(engine).generate(prompt, params)``.
- `SamplingParams`, `GrammarSpec` (its ``structured_output``: what the output must match, enforced
  by the engine token by token), `RequestOutput`, `Completion`, `InvalidRequestError`;
  `RequestFailedError`: one request failed inside the engine (the others and the engine go on);
  `EngineDeadError` (with ``suspect``: the request was in the forward pass that killed the engine).
  `SamplingParams`, `GrammarSpec` and the three errors are `wire`'s, re-exported (the same classes):
  a caller in another process (the gateway) imports them from `wire` without importing the engine
  and torch.
- `ModelConfig`, `UnsupportedModelError`, `CheckpointError`: what a checkpoint is, and why it was refused;
  `kv_pool_tokens`, `kv_bytes_per_token`, `max_model_len_problem`: what an instance's KV pool holds.
- `Tokenizer`: tokenizer + chat template without `transformers`.
- `DemoModelConfig`, `write_demo_model`: a small Llama checkpoint built locally.
- `InstanceWorker`: one model instance (load, ``generate`` streams of `GenerationChunk`, ``abort``,
  ``stats`` -> `InstanceStats`, ``ready`` -> `InstanceLoad`, ``health`` -> `InstanceState`,
  ``shutdown``; ``serving_engine`` and ``open_request_ids`` for a caller serving more than
  ``generate`` from it); `InvalidFieldError` names the refused field, `InstanceLoadError` a failed load.
  The three reports are `wire`'s records (the same classes), re-exported here.
- `InstanceWorkerActor`, `start_instance_worker`, `stop_instance_worker`, `stream_generation`:
  the instance as a Ray actor, and the caller's side of its stream; `start_spare_worker`: a worker
  process started ahead of demand that a model is later ``assign``-ed to (`SpareWorkerError`);
  `worker_actor_options`: the Ray options every worker actor starts with (for subclasses' starters).
- Live migration hooks: `RequestSnapshot` (a request without its KV), the functions of
  `worker.transfer.engine_migration` (export/freeze/release a request, read/write its KV blocks, import
  one) and `worker.transfer.layer_handoff` (a prefill moved at a layer), `MigrationRefusedError`,
  `UnknownRequestError`; `AsyncEngine.call` runs them between steps. Both modules are built only
  on ``Engine.requests`` (`RequestLifecycle`: pause, resume, snapshot, adopt, replay, retire, KV
  blocks in and out), the engine's public surface for moving requests.
  `checkpoint_identity`: which checkpoint a model dir holds (a request moves only between equals);
  `RequestProgress`, `RequestState`: where a request stands, for a client whose stream went quiet.
"""

from worker.serving.async_engine import AsyncEngine
from worker.loading.checkpoint import CheckpointError
from worker.loading.checkpoint_identity import checkpoint_identity
from worker.models.demo_model import DemoModelConfig, write_demo_model
from worker.engine.engine import Engine
from worker.engine.engine_config import EngineConfig
from worker.transfer.engine_migration import MigrationRefusedError, UnknownRequestError
from worker.serving.instance_worker import (GenerationChunk, InstanceBusyError, InstanceLoadError,
                                            InstanceWorker, InvalidFieldError, SourceUnavailableError)
from worker.serving.instance_worker_actor import (
    InstanceWorkerActor, SpareWorkerError, start_instance_worker, start_spare_worker, stop_instance_worker,
    stream_generation, worker_actor_options,
)
from worker.loading.layer_gate import LayerLoadError
from worker.loading.peer_weights import PeerWeights
from worker.engine.kv_budget import kv_bytes_per_token, kv_pool_tokens, max_model_len_problem
from worker.models.model_config import ModelConfig, UnsupportedModelError
from worker.engine.request_output import Completion, RequestOutput
from worker.engine.request_lifecycle import RequestLifecycle
from worker.transfer.request_progress import RequestProgress, RequestState
from wire.request_snapshot import RequestSnapshot
from wire.sampling_params import SamplingParams
from worker.text.tokenizer import Tokenizer
from wire import InstanceLoad, InstanceState, InstanceStats  # the reports, defined in wire/; re-exported
from wire import EngineDeadError, GrammarSpec, InvalidRequestError, RequestFailedError  # re-exported: see the docstring

__all__ = [
    "AsyncEngine", "CheckpointError", "Completion", "DemoModelConfig", "Engine", "EngineConfig",
    "EngineDeadError", "GenerationChunk", "GrammarSpec", "InstanceLoad", "InstanceLoadError", "InstanceState",
    "InstanceBusyError", "InstanceStats",
    "InstanceWorker", "InstanceWorkerActor", "InvalidFieldError", "InvalidRequestError", "LayerLoadError",
    "MigrationRefusedError", "ModelConfig", "PeerWeights", "RequestFailedError", "RequestLifecycle", "RequestOutput",
    "RequestSnapshot",
    "RequestProgress", "RequestState", "SamplingParams",
    "SourceUnavailableError", "SpareWorkerError", "Tokenizer", "UnknownRequestError", "UnsupportedModelError",
    "checkpoint_identity", "start_instance_worker", "start_spare_worker",
    "stop_instance_worker", "stream_generation", "worker_actor_options", "write_demo_model",
    "kv_bytes_per_token", "kv_pool_tokens", "max_model_len_problem",
]
