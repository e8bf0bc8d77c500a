"""Tests for the wire records (wire/*.py): exact dict forms with their schema tag, round trips
through the dict form and through pickle (Ray's way), and refusals that name the bad field."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from wire import (ChatPrompt, FinishReason, GenerationChunk, InstanceLoadRecord, InstanceRoute, ModelRecord,
                  SamplingParams, TokenLogprobs, WireRecord)

CHUNK = GenerationChunk(request_id="r1", text="secret words", token_ids=(5, 6), finish_reason=None,
                        num_prompt_tokens=3, num_completion_tokens=2, num_cached_tokens=2)
ROUTE = InstanceRoute("i1", "thaw-worker-i1", "thaw", "node0", 4)
LOADS = (InstanceLoadRecord(instance_id="i1", tier="dram", load_s=0.25),
         InstanceLoadRecord(instance_id="i2", tier=None, load_s=None))
MODEL = ModelRecord(model_id="acme/m1", deployed_s=1_700_000_123.5, max_model_len=2048, max_queued_requests=7,
                    queue_timeout_s=3.0, instances=LOADS)
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], stop_token_ids=[2], seed=9)
# Every sampling setting on, logit_bias given as JSON gives it (string keys).
TUNED = SamplingParams(max_tokens=6, presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.3,
                       min_p=0.05, logit_bias={"17": -100, 3: 2.5}, min_tokens=2, logprobs=3)
LOGPROBS = TokenLogprobs(token_id=5, token=" secret", logprob=-0.25, top_token_ids=(5, 9), top_tokens=(" secret", "x"),
                         top_logprobs=(-0.25, float("-inf")))
LOGPROB_CHUNK = GenerationChunk(request_id="r2", text=" secret", token_ids=(5,), finish_reason="stop",
                                num_prompt_tokens=3, num_completion_tokens=1, logprobs=(LOGPROBS,))
TOOL_MODEL = ModelRecord(model_id="acme/q", deployed_s=None, max_model_len=None, max_queued_requests=1,
                         queue_timeout_s=1.0, tool_call_format="hermes")
CHAT = ChatPrompt(messages=({"role": "user", "content": "hi"},
                            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}),
                  tools=({"type": "function", "function": {"name": "f"}},), template_kwargs={"enable_thinking": False})
RECORDS = [CHUNK, ROUTE, *LOADS, MODEL, PARAMS, TUNED, LOGPROBS, LOGPROB_CHUNK, TOOL_MODEL, CHAT]


def test_each_record_has_an_exact_tagged_dict_form():
    assert CHUNK.to_dict() == {"schema": "generation_chunk/1", "request_id": "r1", "text": "secret words",
                               "token_ids": [5, 6], "finish_reason": None, "num_prompt_tokens": 3,
                               "num_completion_tokens": 2, "queue_s": None, "logprobs": None,
                               "num_cached_tokens": 2}
    assert ROUTE.to_dict() == {"schema": "instance_route/1", "instance_id": "i1", "actor_name": "thaw-worker-i1",
                               "namespace": "thaw", "node_id": "node0", "num_ongoing_requests": 4,
                               "hosted": False}
    assert MODEL.to_dict() == {
        "schema": "model_record/1", "model_id": "acme/m1", "deployed_s": 1_700_000_123.5, "max_model_len": 2048,
        "max_queued_requests": 7, "queue_timeout_s": 3.0,
        "instances": [{"schema": "instance_load/1", "instance_id": "i1", "tier": "dram", "load_s": 0.25},
                      {"schema": "instance_load/1", "instance_id": "i2", "tier": None, "load_s": None}],
        "tool_call_format": None}
    assert PARAMS.to_dict() == {"schema": "sampling_params/1", "max_tokens": 5, "temperature": 0.0, "top_k": 0,
                                "top_p": 1.0, "seed": 9, "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": False,
                                "model_defaults": [], "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                "repetition_penalty": 1.0, "min_p": 0.0, "logit_bias": [], "min_tokens": 0,
                                "logprobs": None, "skip_special_tokens": True, "structured_output": None}
    assert TUNED.logit_bias == ((3, 2.5), (17, -100.0))  # sorted pairs, JSON's string key read as an id
    assert [TUNED.to_dict()[key] for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                                             "logit_bias", "min_tokens", "logprobs")] == \
        [0.5, -1.5, 1.3, 0.05, [[3, 2.5], [17, -100.0]], 2, 3]
    assert LOGPROB_CHUNK.to_dict()["logprobs"] == [{
        "schema": "token_logprobs/1", "token_id": 5, "token": " secret", "logprob": -0.25, "top_token_ids": [5, 9],
        "top_tokens": [" secret", "x"], "top_logprobs": [-0.25, float("-inf")]}]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_its_dict_and_through_pickle(record):
    assert type(record).from_dict(record.to_dict()) == record
    copy = pickle.loads(pickle.dumps(record))
    assert copy == record and type(copy) is type(record)


def test_pickling_goes_through_the_tagged_dict_so_another_version_is_refused_on_arrival():
    rebuild, (data,) = MODEL.__reduce__()
    assert rebuild(data) == MODEL and data["schema"] == "model_record/1"
    with pytest.raises(ValueError, match=r"model_record.schema is 'model_record/2', but this process reads "
                                         r"'model_record/1': run the same thaw version"):
        rebuild({**data, "schema": "model_record/2"})


def test_a_dict_without_a_tag_is_read_as_the_current_version():
    untagged = {key: value for key, value in ROUTE.to_dict().items() if key != "schema"}
    assert InstanceRoute.from_dict(untagged) == ROUTE


@pytest.mark.parametrize("record_type, data, message", [
    (InstanceRoute, {"instance_id": "i1", "actor_name": "a", "namespace": None}, "instance_route.node_id is missing"),
    (InstanceRoute, {**ROUTE.to_dict(), "weight": 1}, "instance_route: unknown field 'weight'"),
    (InstanceRoute, {**ROUTE.to_dict(), "num_ongoing_requests": -1},
     "instance_route.num_ongoing_requests must be an integer >= 0, got -1"),
    (InstanceRoute, ["i1"], "instance_route must be a mapping of its fields, got list"),
    (ModelRecord, {**MODEL.to_dict(), "tool_call_format": "qwen"},
     "model_record.tool_call_format must be None or one of hermes, llama3_json, mistral, got 'qwen'"),
    (ChatPrompt, {"messages": []}, "chat_prompt.messages must be a non-empty list of objects"),
    (ChatPrompt, {"messages": [{"content": "x"}]}, r"chat_prompt.messages\[0\].role must be a string"),
    (ChatPrompt, {"messages": [{"role": "user", "content": "x"}], "tools": ["f"]},
     r"chat_prompt.tools\[0\] must be an object, got str"),
    (GenerationChunk, {**CHUNK.to_dict(), "token_ids": [1, -2]},
     r"generation_chunk.token_ids\[1\] must be a token id \(an integer >= 0\), got -2"),
    (GenerationChunk, {**CHUNK.to_dict(), "num_completion_tokens": True},
     "generation_chunk.num_completion_tokens must be an integer >= 0, got True"),
    (GenerationChunk, {**CHUNK.to_dict(), "num_cached_tokens": -1},
     "generation_chunk.num_cached_tokens must be an integer >= 0, got -1"),
    (GenerationChunk, {**CHUNK.to_dict(), "queue_s": float("nan")},
     "generation_chunk.queue_s must be a finite number >= 0, got nan"),
    (GenerationChunk, {**CHUNK.to_dict(), "request_id": ""},
     "generation_chunk.request_id must be a non-empty string"),
    (ModelRecord, {**MODEL.to_dict(), "model_id": "acme"}, "model_record.model_id must be 'tenant/name', got 'acme'"),
    (ModelRecord, {**MODEL.to_dict(), "queue_timeout_s": 0},
     "model_record.queue_timeout_s must be a finite number > 0"),
    (ModelRecord, {**MODEL.to_dict(), "max_queued_requests": 0},
     "model_record.max_queued_requests must be an integer >= 1, got 0"),
    (ModelRecord, {**MODEL.to_dict(), "instances": [{"instance_id": "i1", "tier": "dram", "load_s": -1}]},
     r"model_record.instances\[0\]: instance_load.load_s must be a finite number >= 0, got -1"),
    (SamplingParams, {"temperature": -1}, "temperature must be >= 0, got -1"),
    (SamplingParams, {"max_tokens": 4, "beam_width": 2}, "sampling_params: unknown field 'beam_width'"),
    (SamplingParams, {"logit_bias": [[3, 1.0], [3, 2.0]]}, "logit_bias names token 3 twice"),
    (GenerationChunk, {**CHUNK.to_dict(), "logprobs": [LOGPROBS.to_dict()]},
     "generation_chunk.logprobs must have one entry per token: 1 for 2 tokens"),
    (GenerationChunk, {**LOGPROB_CHUNK.to_dict(), "logprobs": [{**LOGPROBS.to_dict(), "logprob": float("nan")}]},
     r"generation_chunk.logprobs\[0\]: token_logprobs.logprob must be a log-probability \(a number, -inf allowed\), "
     "got nan"),
    (TokenLogprobs, {**LOGPROBS.to_dict(), "top_tokens": ["only one"]},
     "token_logprobs: top_token_ids, top_tokens and top_logprobs must have one entry per alternative, got 2, 1 and 2"),
    (TokenLogprobs, {**LOGPROBS.to_dict(), "token_id": -1},
     r"token_logprobs.token_id must be a token id \(an integer >= 0\), got -1"),
])
def test_a_bad_field_is_refused_by_name(record_type, data, message):
    with pytest.raises(ValueError, match=message):
        record_type.from_dict(data)


def test_a_chunk_normalises_its_tokens_hides_its_text_and_knows_when_it_ends():
    chunk = GenerationChunk(request_id="r", text="hidden", token_ids=[7], finish_reason=FinishReason.SUSPENDED.value,
                            num_prompt_tokens=1, num_completion_tokens=1)
    assert chunk.token_ids == (7,) and chunk.finished and "hidden" not in repr(chunk)
    assert not CHUNK.finished and "secret" not in repr(CHUNK) and "secret" not in repr(MODEL)
    assert "secret" not in repr(LOGPROB_CHUNK) and "secret" not in repr(LOGPROBS)  # token strings are completion text
    assert LOGPROBS.top == ((5, " secret", -0.25), (9, "x", float("-inf")))


def test_routes_are_built_positionally_by_the_controller_and_models_know_their_tenant():
    assert ROUTE == InstanceRoute(instance_id="i1", actor_name="thaw-worker-i1", namespace="thaw", node_id="node0",
                                  num_ongoing_requests=4)
    assert MODEL.tenant == "acme"


def test_every_record_is_a_wire_record_with_a_distinct_schema():
    schemas = [cls.SCHEMA for cls in (GenerationChunk, InstanceRoute, InstanceLoadRecord, ModelRecord, SamplingParams,
                                      TokenLogprobs)]
    assert all(issubclass(type(r), WireRecord) for r in RECORDS)
    assert schemas == ["generation_chunk/1", "instance_route/1", "instance_load/1", "model_record/1",
                       "sampling_params/1", "token_logprobs/1"]


def test_engine_gauges_round_trip_and_refuse_impossible_figures():
    from wire import EngineGauges

    gauges = EngineGauges("i1", "acme/m", "node0", 3, 1, 0.25)
    assert EngineGauges.from_dict(gauges.to_dict()) == gauges and pickle.loads(pickle.dumps(gauges)) == gauges
    assert gauges.to_dict()["schema"] == "engine_gauges/1"
    for field, value, match in (("num_running_requests", -1, "num_running_requests"),
                                ("kv_cache_usage", 1.5, "kv_cache_usage must be a fraction in 0..1"),
                                ("kv_cache_usage", float("nan"), "kv_cache_usage must be a fraction"),
                                ("node_id", None, "node_id must be a string")):
        with pytest.raises(ValueError, match=match):
            EngineGauges(**{**dataclasses.asdict(gauges), field: value})


def test_gateway_metrics_snapshot_round_trips_hides_its_text_and_refuses_bad_fields():
    from wire import GatewayMetricsSnapshot
    from wire.gateway_metrics_snapshot import MAX_SNAPSHOT_BYTES

    snapshot = GatewayMetricsSnapshot("r1", "node0", 'thaw_gateway_requests_total{model="m"} 1.0\n')
    assert GatewayMetricsSnapshot.from_dict(snapshot.to_dict()) == snapshot
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot
    assert "thaw_gateway_requests_total" not in repr(snapshot)
    for field, value, match in (("replica_id", "", "replica_id must be a non-empty string"),
                                ("node_id", None, "node_id must be a string"),
                                ("text", b"bytes", "text must be a string"),
                                ("text", "x" * (MAX_SNAPSHOT_BYTES + 1), "over the")):
        with pytest.raises(ValueError, match=match):
            GatewayMetricsSnapshot(**{**dataclasses.asdict(snapshot), field: value})
