"""The records that cross process boundaries, and the one way to call Ray actors.

The controller, the gateway, the workers and the migration driver run in different processes;
whatever passes between them is defined here once and imported by both sides (house rule 11),
so a key written on one side is the key read on the other. Each record is a frozen dataclass
that checks its fields (naming the bad one), has a tagged dict form (``"schema": "<record>/<n>"``,
`to_dict` / `from_dict`), and crosses Ray through that form, checked again on arrival.

This package imports no other thaw folder, and neither torch nor Ray at import time (the
gateway's HTTP app imports it), so every folder may import it. Messages that carry tensors (the
migration's `KVPayload`, `PartialPrefillPayload`) stay in `migration/`, since wire imports no torch.

Public API:
- `SamplingParams`: how a request samples and stops (gateway -> worker), with `GrammarSpec`
  (`GRAMMAR_KINDS`), what its output must match when it asks for structured output; `MAX_LOGPROBS`, the most
  alternatives its ``logprobs`` may ask for.
- `TokenLogprobs`: one generated token's log-probability and its position's most likely tokens,
  carried in `GenerationChunk.logprobs` (worker -> gateway).
- `Prompt`, `ChatMessage`, `ChatPrompt`: what a request asks (a chat with its tools and template
  arguments); `GenerationChunk`: what its stream carries
  (worker -> gateway), and `FinishReason`, how its stream ended (the engine's, the workers', the
  migration's and the gateway's one spelling).
- `TOOL_CALL_FORMATS`, `detect_tool_call_format`: the text formats models write tool calls in,
  and which one a chat template teaches (controller -> gateway, in `ModelRecord`).
- `InstanceRoute`: one ready instance in the controller's routing table (controller -> gateway).
- `HostedInstance` (`is_hosted`, `is_slot_host`): an instance in a slot host, called like an actor.
- `EngineGauges`: a ready instance's running/waiting requests and KV-cache use, for ``/metrics``
  (controller -> gateway).
- `GatewayMetricsSnapshot`: one gateway replica's per-request series, relayed to its peers so any
  replica's ``/metrics`` covers them all (gateway -> controller -> gateway).
- `InstanceStats`, `InstanceLoad`: what a worker reports about itself -- its load now and how its
  model was loaded (worker -> controller); `InstanceState`, where an instance is in its life, the
  one spelling of the worker, the controller (and its state store) and the simulator.
- `ModelRecord`, `InstanceLoadRecord`: a deployed model as the gateway needs it, with when it
  was deployed (controller -> gateway).
- `RequestSnapshot`: a request's state without its KV (source worker -> migration driver ->
  destination worker); `MigrationOutcome`, with `MigrationMethod` and `MigrationStatus`: how one
  live migration went (migration driver -> controller -> CLI); `MigrationReport`: the answer to
  one ``migrate`` call, its source, destination and outcomes (controller -> admin API -> CLI).
- `DeployProgress`, with `DeployState` and `DeployStage`: where one deploy job stands, its stage,
  bytes, rate and ETA, or why it failed (controller -> gateway -> CLI).
- `WireRecord`: the base of the records (schema tag, dict form, pickling through it).
- `InvalidRequestError` (refused, a `ValueError`), `RequestFailedError` (failed alone; the engine
  serves on), `EngineDeadError` (the engine stopped; ``suspect``): how a request's stream ends on
  a worker, raised there and caught by the gateway and the migration driver (worker -> callers).
- `call`, `stream`, `ray_errors_translated`, `translated`, `is_ours`: awaiting actor calls and
  streams with Ray's errors translated once; `ActorGoneError` (the actor is dead),
  `ActorUnreachableError` (for now; a `TimeoutError`).
"""

from wire.chat_prompt import ChatPrompt
from wire.grammar_spec import GRAMMAR_KINDS, GrammarSpec
from wire.finish_reason import FinishReason
from wire.generation_chunk import ChatMessage, GenerationChunk, Prompt
from wire.deploy_progress import DeployProgress, DeployStage, DeployState
from wire.engine_gauges import EngineGauges
from wire.gateway_metrics_snapshot import GatewayMetricsSnapshot
from wire.hosted_instance import HostedInstance, is_hosted, is_slot_host
from wire.instance_route import InstanceRoute
from wire.instance_state import InstanceState
from wire.instance_stats import InstanceLoad, InstanceStats
from wire.migration_outcome import MigrationMethod, MigrationOutcome, MigrationStatus
from wire.migration_report import MigrationReport
from wire.model_record import InstanceLoadRecord, ModelRecord
from wire.ray_calls import (ActorGoneError, ActorUnreachableError, call, is_ours, ray_errors_translated, stream,
                            translated)
from wire.request_errors import EngineDeadError, InvalidRequestError, RequestFailedError
from wire.request_snapshot import RequestSnapshot
from wire.sampling_params import MAX_LOGPROBS, MODEL_DEFAULT_FIELDS, SamplingParams
from wire.token_logprobs import TokenLogprobs
from wire.tool_call_format import TOOL_CALL_FORMATS, detect_tool_call_format
from wire.wire_record import WireRecord

__all__ = [
    "GRAMMAR_KINDS", "GrammarSpec", "MAX_LOGPROBS", "MODEL_DEFAULT_FIELDS", "TOOL_CALL_FORMATS", "TokenLogprobs", "detect_tool_call_format",
    "ActorGoneError", "ActorUnreachableError", "ChatMessage", "FinishReason", "ChatPrompt", "GenerationChunk", "InstanceLoadRecord",
    "EngineGauges", "GatewayMetricsSnapshot", "HostedInstance", "InstanceRoute", "is_hosted", "is_slot_host", "ModelRecord", "Prompt", "SamplingParams", "WireRecord", "call", "is_ours",
    "ray_errors_translated", "stream", "translated",
    "InstanceLoad", "InstanceState", "InstanceStats",
    "EngineDeadError", "InvalidRequestError", "RequestFailedError",
    "DeployProgress", "DeployStage", "DeployState",
    "MigrationMethod", "MigrationOutcome", "MigrationReport", "MigrationStatus", "RequestSnapshot",
]
