"""Tests for the migration's wire records (wire/request_snapshot.py, wire/migration_outcome.py,
wire/migration_report.py): refusals that name the field, exact tagged dict forms, round trips
through the dict and through pickle (generator bytes and nested `SamplingParams` and outcomes
included), and a snapshot of another schema version refused on arrival."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

import importlib.util

import migration
import worker
from wire import MigrationMethod, MigrationOutcome, MigrationStatus, RequestSnapshot, SamplingParams

PARAMS = SamplingParams(max_tokens=9, temperature=0.5, seed=3, stop=["\n"])
STATE = bytes(range(256)) * 20  # 5,120 bytes, every byte value: as opaque as a generator's state
SNAPSHOT = RequestSnapshot("r1", (5, 6, 7), (8,), PARAMS, 3, STATE, "cpu", "ckpt-00000000000000v1")
OUTCOME = MigrationOutcome("r1", MigrationMethod.KV, MigrationStatus.MIGRATED, "i1", "i2", 2, 40, 1, 3, 3072,
                           0.25, 1.5)


def test_the_packages_export_the_wire_classes_and_the_old_modules_are_gone():
    """One home per record (issue 40): the packages re-export the wire classes, and the modules
    that only re-exported them are deleted."""
    assert worker.RequestSnapshot is RequestSnapshot and worker.SamplingParams is SamplingParams
    assert (migration.MigrationOutcome, migration.MigrationMethod, migration.MigrationStatus) == (
        MigrationOutcome, MigrationMethod, MigrationStatus)
    for old in ("worker.request_snapshot", "worker.sampling_params", "migration.migration_outcome"):
        assert importlib.util.find_spec(old) is None, old


def test_a_snapshot_has_an_exact_tagged_dict_form_with_its_state_as_bytes():
    assert SNAPSHOT.to_dict() == {
        "schema": "request_snapshot/1", "request_id": "r1", "prompt_token_ids": [5, 6, 7], "output_token_ids": [8],
        "params": {"schema": "sampling_params/1", "max_tokens": 9, "temperature": 0.5, "top_k": 0, "top_p": 1.0,
                   "seed": 3, "stop": ["\n"], "stop_token_ids": [], "ignore_eos": False,
                   "model_defaults": [], "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1.0, "min_p": 0.0, "logit_bias": [], "min_tokens": 0, "logprobs": None,
                       "skip_special_tokens": True, "structured_output": None},
        "num_computed_tokens": 3, "generator_state": STATE, "generator_device_type": "cpu",
        "checkpoint_id": "ckpt-00000000000000v1"}
    assert type(SNAPSHOT.to_dict()["generator_state"]) is bytes  # one blob, not a list of ints


def test_an_outcome_has_an_exact_tagged_dict_form_with_plain_strings_for_its_enums():
    data = OUTCOME.to_dict()
    assert data == {"schema": "migration_outcome/1", "request_id": "r1", "method": "kv", "status": "migrated",
                    "source_id": "i1", "destination_id": "i2", "num_rounds": 2, "num_tokens_at_stop": 40,
                    "num_tokens_after_stop": 1, "num_blocks_copied": 3, "num_bytes_copied": 3072, "stop_s": 0.25,
                    "total_s": 1.5, "error": None}
    assert (type(data["method"]), type(data["status"])) == (str, str)
    back = MigrationOutcome.from_dict(json.loads(json.dumps(data)))
    assert back == OUTCOME and back.method is MigrationMethod.KV and back.status is MigrationStatus.MIGRATED
    assert back.migrated


@pytest.mark.parametrize("record", [
    SNAPSHOT,
    RequestSnapshot("r2", [1], [], SamplingParams(), 0),  # no generator state, no checkpoint, lists in
    # Every sampling setting survives the move (logit_bias as sorted pairs).
    RequestSnapshot("r4", [1, 2], [3], SamplingParams(max_tokens=8, presence_penalty=1.0, frequency_penalty=0.5,
                                                      repetition_penalty=1.2, min_p=0.1, logit_bias={7: -3.0, 2: 1.5},
                                                      min_tokens=4, logprobs=2), 1),
    OUTCOME,
    MigrationOutcome("r3", "tokens", "failed", "i1", "i2", 0, 0, 0, 0, 0, 0.0, 0.5, error=""),
], ids=["snapshot", "bare-snapshot", "tuned-snapshot", "outcome", "failed-outcome"])
def test_each_record_round_trips_through_its_dict_and_through_pickle(record):
    assert type(record).from_dict(record.to_dict()) == record
    copy = pickle.loads(pickle.dumps(record))
    assert copy == record and type(copy) is type(record)


def test_pickling_a_snapshot_keeps_its_generator_bytes_params_and_token_tuples():
    copy = pickle.loads(pickle.dumps(SNAPSHOT))
    assert copy.generator_state == STATE and type(copy.generator_state) is bytes
    assert copy.params == PARAMS and type(copy.params) is SamplingParams
    assert (copy.prompt_token_ids, copy.output_token_ids) == ((5, 6, 7), (8,))
    assert (type(copy.prompt_token_ids), type(copy.output_token_ids)) == (tuple, tuple)
    assert copy.token_ids == (5, 6, 7, 8) and (copy.num_prompt_tokens, copy.num_output_tokens) == (3, 1)


def test_a_long_snapshot_pickles_its_tokens_and_state_compactly():
    """4,000 token ids under 65,536 take 3 bytes each in a pickle; the state is one blob."""
    snapshot = RequestSnapshot("long", tuple(range(1000, 4000)), tuple(range(1000)), PARAMS, 3999, STATE)
    data = pickle.dumps(snapshot)
    assert len(data) < 4000 * 3 + len(STATE) + 1024
    assert pickle.loads(data) == snapshot


def test_a_snapshot_of_another_schema_version_is_refused_on_arrival():
    rebuild, (data,) = SNAPSHOT.__reduce__()
    assert rebuild(data) == SNAPSHOT and data["schema"] == "request_snapshot/1"
    with pytest.raises(ValueError, match=r"request_snapshot.schema is 'request_snapshot/2', but this process reads "
                                         r"'request_snapshot/1': run the same thaw version"):
        rebuild({**data, "schema": "request_snapshot/2"})


def test_a_snapshot_prints_without_its_tokens_or_state_and_is_rebuilt_by_replace():
    assert repr(SNAPSHOT) == ("RequestSnapshot(request_id='r1', num_computed_tokens=3, generator_device_type='cpu', "
                              "checkpoint_id='ckpt-00000000000000v1')")
    moved = dataclasses.replace(SNAPSHOT, checkpoint_id=None)
    assert moved.checkpoint_id is None and moved.generator_state == STATE


def test_a_snapshot_takes_its_state_as_any_bytes_like_and_keeps_bytes():
    snapshot = RequestSnapshot("r", (1, 2), (), PARAMS, 1, bytearray(b"\x01\x02"))
    assert snapshot.generator_state == b"\x01\x02" and type(snapshot.generator_state) is bytes


SNAP = SNAPSHOT.to_dict()


@pytest.mark.parametrize("data, message", [
    ({**SNAP, "request_id": ""}, "request_snapshot.request_id must be a non-empty string, got ''"),
    ({**SNAP, "prompt_token_ids": []}, "request_snapshot.prompt_token_ids: a snapshot needs a non-empty prompt"),
    ({**SNAP, "prompt_token_ids": [1, -1]},
     r"request_snapshot.prompt_token_ids\[1\] must be a token id \(an integer >= 0\), got -1"),
    ({**SNAP, "output_token_ids": "ab"}, "request_snapshot.output_token_ids must be a list of token ids, got str"),
    ({**SNAP, "params": {"max_tokens": 0}},
     "request_snapshot.params: max_tokens must be an integer >= 1, got 0"),
    ({**SNAP, "params": 7}, "request_snapshot.params: sampling_params must be a mapping of its fields, got int"),
    ({**SNAP, "num_computed_tokens": 4},
     r"request_snapshot.num_computed_tokens must be in \[0, 4\) \(the last token's KV is computed by the next step\), "
     "got 4"),
    ({**SNAP, "num_computed_tokens": -1}, r"request_snapshot.num_computed_tokens must be in \[0, 4\)"),
    ({**SNAP, "num_computed_tokens": 1.5}, r"request_snapshot.num_computed_tokens must be in \[0, 4\).*got 1.5"),
    ({**SNAP, "generator_state": [1, 2]},
     r"request_snapshot.generator_state must be None or bytes \(torch.Generator.get_state\(\)\), got list"),
    ({**SNAP, "generator_device_type": "mps"},
     "request_snapshot.generator_device_type must be 'cpu' or 'cuda', got 'mps'"),
    ({**SNAP, "checkpoint_id": ""}, "request_snapshot.checkpoint_id must be None or a non-empty string, got ''"),
    ({key: value for key, value in SNAP.items() if key != "params"}, "request_snapshot.params is missing"),
    ({**SNAP, "kv": b""}, "request_snapshot: unknown field 'kv'"),
], ids=["request_id", "empty-prompt", "token-id", "tokens-type", "params-field", "params-type", "computed-all",
        "computed-negative", "computed-float", "state-type", "device-type", "checkpoint", "missing", "unknown"])
def test_a_bad_snapshot_field_is_refused_by_name(data, message):
    with pytest.raises(ValueError, match=message):
        RequestSnapshot.from_dict(data)


def test_a_snapshot_built_directly_is_checked_the_same_way():
    with pytest.raises(ValueError, match="request_snapshot.params must be SamplingParams, got dict"):
        RequestSnapshot("r", (1,), (), {"max_tokens": 1}, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_snapshot.prompt_token_ids: a snapshot needs a non-empty prompt"):
        RequestSnapshot("r", (), (1,), PARAMS, 0)


OUT = OUTCOME.to_dict()


@pytest.mark.parametrize("data, message", [
    ({**OUT, "request_id": None}, "migration_outcome.request_id must be a non-empty string, got None"),
    ({**OUT, "method": "teleport"}, "migration_outcome.method must be one of 'tokens', 'kv', 'layer', got 'teleport'"),
    ({**OUT, "status": "done"},
     "migration_outcome.status must be one of 'migrated', 'refused', 'failed', 'finished', got 'done'"),
    ({**OUT, "source_id": ""}, "migration_outcome.source_id must be a non-empty string, got ''"),
    ({**OUT, "destination_id": 2}, "migration_outcome.destination_id must be a non-empty string, got 2"),
    ({**OUT, "num_rounds": -1}, "migration_outcome.num_rounds must be an integer >= 0, got -1"),
    ({**OUT, "num_bytes_copied": 1.0}, "migration_outcome.num_bytes_copied must be an integer >= 0, got 1.0"),
    ({**OUT, "stop_s": -0.5}, "migration_outcome.stop_s must be a finite number >= 0, got -0.5"),
    ({**OUT, "total_s": float("inf")}, "migration_outcome.total_s must be a finite number >= 0, got inf"),
    ({**OUT, "error": 3}, "migration_outcome.error must be None or a string, got int"),
    ({**OUT, "schema": "migration_outcome/2"}, "migration_outcome.schema is 'migration_outcome/2'"),
], ids=["request_id", "method", "status", "source", "destination", "rounds", "bytes", "stop_s", "total_s", "error",
        "schema"])
def test_a_bad_outcome_field_is_refused_by_name(data, message):
    with pytest.raises(ValueError, match=message):
        MigrationOutcome.from_dict(data)


def test_the_records_carry_distinct_schema_tags():
    assert (RequestSnapshot.SCHEMA, MigrationOutcome.SCHEMA) == ("request_snapshot/1", "migration_outcome/1")


def test_a_migration_report_round_trips_with_its_outcomes_and_sums_them():
    from wire import MigrationReport

    other = dataclasses.replace(OUTCOME, request_id="r2", status=MigrationStatus.REFUSED, stop_s=0.0,
                                error="no KV blocks")
    report = MigrationReport("i1", "i2", "node0", "kv", (OUTCOME, other))
    data = report.to_dict()
    assert data["schema"] == "migration_report/1" and data["method"] == "kv"
    assert [o["request_id"] for o in data["outcomes"]] == ["r1", "r2"]
    assert MigrationReport.from_dict(json.loads(json.dumps(data))) == report
    assert pickle.loads(pickle.dumps(report)) == report
    assert (report.num_migrated, report.stop_s_max) == (1, 0.25)
    assert MigrationReport("i1", "i2", "node0", MigrationMethod.TOKENS).stop_s_max == 0.0


@pytest.mark.parametrize("change, message", [
    (dict(method="teleport"), r"migration_report.method must be one of 'tokens', 'kv', 'layer'"),
    (dict(node_id=""), "migration_report.node_id must be a non-empty string"),
    (dict(outcomes=[{"request_id": "r1"}]), r"migration_report.outcomes\[0\]: migration_outcome.method is missing"),
])
def test_a_bad_migration_report_names_its_field(change, message):
    from wire import MigrationReport

    data = {**MigrationReport("i1", "i2", "node0", "kv", (OUTCOME,)).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        MigrationReport.from_dict(data)
