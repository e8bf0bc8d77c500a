"""Tests for the worker's reports (wire/instance_stats.py): the values real instances send are
accepted (a loading one's zeros, epoch seconds, an unknown pid), the exact tagged dict form with
the state as its plain value, round trips through the dict and pickle, and refusals that name
the bad field."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

import worker
from wire import InstanceLoad, InstanceLoadRecord, InstanceState, InstanceStats, WireRecord
from wire.instance_stats import REPORTED_STATES

LOAD = InstanceLoad(instance_id="i1", model_id="acme/m1", model_dir="/nodes/n0/dram/m1", load_s=1.25,
                    weights_load_s=0.75, weights_read="safetensors: 1 file(s), 2.0 MB", num_kv_blocks=64,
                    block_size=16, max_model_len=2048)
STREAMED = dataclasses.replace(LOAD, weights_load_s=None)  # fed by a peer: ready before its weights are in
STATS = InstanceStats(instance_id="i1", model_id="acme/m1", state=InstanceState.READY, num_ongoing_requests=3,
                      num_waiting_requests=1, num_running_requests=2, num_free_kv_blocks=48, num_kv_blocks=64,
                      num_generated_tokens=120, started_at=1_700_000_000.5, load_s=1.25, weights_read="safetensors",
                      weights_resident=False, num_weight_streams=1, prefills_at_frontier=("r1", "r2"),
                      num_requests_started=9, pid=4242, num_prefix_cache_queried_tokens=300,
                      num_prefix_cache_hit_tokens=120)
# What `InstanceWorker.stats()` sends while the model loads: zeros, nothing read yet, defaults.
LOADING = InstanceStats("i2", "acme/m1", InstanceState.LOADING, 0, 0, 0, 0, 0, 0, 1_700_000_000.0, 0.0, "")
RECORDS = [LOAD, STREAMED, STATS, LOADING]


def test_a_loading_instance_reports_zeros_and_the_defaults():
    assert (LOADING.weights_resident, LOADING.num_weight_streams, LOADING.prefills_at_frontier,
            LOADING.num_requests_started, LOADING.pid, LOADING.num_prefix_cache_queried_tokens,
            LOADING.num_prefix_cache_hit_tokens) == (True, 0, (), 0, 0, 0, 0)
    assert LOADING.kv_cache_usage == 0.0 and STATS.kv_cache_usage == 0.25


def test_each_report_has_an_exact_tagged_dict_form_with_the_state_as_its_value():
    assert LOAD.to_dict() == {"schema": "instance_ready/1", "instance_id": "i1", "model_id": "acme/m1",
                              "model_dir": "/nodes/n0/dram/m1", "load_s": 1.25, "weights_load_s": 0.75,
                              "weights_read": "safetensors: 1 file(s), 2.0 MB", "num_kv_blocks": 64,
                              "block_size": 16, "max_model_len": 2048, "weights_pack_s": 0.0}
    data = STATS.to_dict()
    assert data == {"schema": "instance_stats/1", "instance_id": "i1", "model_id": "acme/m1", "state": "ready",
                    "num_ongoing_requests": 3, "num_waiting_requests": 1, "num_running_requests": 2,
                    "num_free_kv_blocks": 48, "num_kv_blocks": 64, "num_generated_tokens": 120,
                    "started_at": 1_700_000_000.5, "load_s": 1.25, "weights_read": "safetensors",
                    "weights_resident": False, "num_weight_streams": 1, "prefills_at_frontier": ["r1", "r2"],
                    "num_requests_started": 9, "pid": 4242, "num_prefix_cache_queried_tokens": 300,
                    "num_prefix_cache_hit_tokens": 120}
    assert type(data["state"]) is str  # the plain value, not the enum member (which compares equal to it)
    assert InstanceStats.from_dict(json.loads(json.dumps(data))) == STATS


@pytest.mark.parametrize("record", RECORDS, ids=["load", "streamed", "stats", "loading"])
def test_every_report_round_trips_through_its_dict_and_through_pickle(record):
    copy = type(record).from_dict(record.to_dict())
    assert copy == record
    copy = pickle.loads(pickle.dumps(record))
    assert copy == record and type(copy) is type(record)
    if isinstance(record, InstanceStats):
        assert copy.state is record.state and copy.prefills_at_frontier == record.prefills_at_frontier


def test_pickling_goes_through_the_tagged_dict_so_another_version_is_refused_on_arrival():
    rebuild, (data,) = STATS.__reduce__()
    assert data["schema"] == "instance_stats/1" and data["state"] == "ready"
    with pytest.raises(ValueError, match=r"instance_stats.schema is 'instance_stats/2', but this process reads "
                                         r"'instance_stats/1': run the same thaw version"):
        rebuild({**data, "schema": "instance_stats/2"})


def test_state_is_normalised_to_the_enum_and_every_state_round_trips():
    assert InstanceStats.from_dict({**STATS.to_dict(), "state": "failed"}).state is InstanceState.FAILED
    for state in REPORTED_STATES:
        stats = dataclasses.replace(LOADING, state=state)
        assert stats.to_dict()["state"] == state.value and InstanceStats.from_dict(stats.to_dict()).state is state
    # STOPPING is the controller's view of an instance it stopped; no worker reports it.
    assert set(InstanceState) - set(REPORTED_STATES) == {InstanceState.STOPPING}
    with pytest.raises(ValueError, match="instance_stats.state must be one of 'spare', .*, got 'stopping'"):
        dataclasses.replace(LOADING, state=InstanceState.STOPPING)


def test_a_replaced_report_is_checked_again_as_migration_does_with_its_count():
    assert dataclasses.replace(STATS, num_ongoing_requests=5).num_ongoing_requests == 5
    with pytest.raises(ValueError, match="instance_stats.num_ongoing_requests must be an integer >= 0, got -1"):
        dataclasses.replace(STATS, num_ongoing_requests=-1)


@pytest.mark.parametrize("record_type, data, message", [
    (InstanceStats, {**STATS.to_dict(), "state": "dozing"},
     "instance_stats.state must be one of 'spare', 'loading', 'ready', 'asleep', 'failed', 'stopped', got 'dozing'"),
    (InstanceStats, {**STATS.to_dict(), "num_waiting_requests": -1},
     "instance_stats.num_waiting_requests must be an integer >= 0, got -1"),
    (InstanceStats, {**STATS.to_dict(), "num_kv_blocks": 1.5}, "instance_stats.num_kv_blocks must be an integer >= 0"),
    (InstanceStats, {**STATS.to_dict(), "pid": True}, "instance_stats.pid must be an integer >= 0, got True"),
    (InstanceStats, {**STATS.to_dict(), "started_at": float("inf")},
     "instance_stats.started_at must be a finite number >= 0, got inf"),
    (InstanceStats, {**STATS.to_dict(), "load_s": -0.5}, "instance_stats.load_s must be a finite number >= 0"),
    (InstanceStats, {**STATS.to_dict(), "model_id": ""}, "instance_stats.model_id must be a non-empty string"),
    (InstanceStats, {**STATS.to_dict(), "weights_read": None}, "instance_stats.weights_read must be a string"),
    (InstanceStats, {**STATS.to_dict(), "weights_resident": 1},
     "instance_stats.weights_resident must be true or false, got 1"),
    (InstanceStats, {**STATS.to_dict(), "prefills_at_frontier": ["r1", ""]},
     r"instance_stats.prefills_at_frontier\[1\] must be a non-empty string"),
    (InstanceStats, {**STATS.to_dict(), "prefills_at_frontier": "r1"},
     "instance_stats.prefills_at_frontier must be a list of request ids, got str"),
    (InstanceStats, {key: value for key, value in STATS.to_dict().items() if key != "started_at"},
     "instance_stats.started_at is missing"),
    (InstanceStats, {**STATS.to_dict(), "gpu": 0}, "instance_stats: unknown field 'gpu'"),
    (InstanceLoad, {**LOAD.to_dict(), "instance_id": None}, "instance_ready.instance_id must be a non-empty string"),
    (InstanceLoad, {**LOAD.to_dict(), "model_dir": ""}, "instance_ready.model_dir must be a non-empty string"),
    (InstanceLoad, {**LOAD.to_dict(), "weights_load_s": float("nan")},
     "instance_ready.weights_load_s must be a finite number >= 0, got nan"),
    (InstanceLoad, {**LOAD.to_dict(), "num_kv_blocks": 0},
     "instance_ready.num_kv_blocks must be an integer >= 1, got 0"),
    (InstanceLoad, {**LOAD.to_dict(), "block_size": 0}, "instance_ready.block_size must be an integer >= 1, got 0"),
    (InstanceLoad, {**LOAD.to_dict(), "max_model_len": -4},
     "instance_ready.max_model_len must be an integer >= 1, got -4"),
    (InstanceLoad, {**LOAD.to_dict(), "weights_pack_s": -1.0},
     "instance_ready.weights_pack_s must be a finite number >= 0, got -1.0"),
    (InstanceLoad, {**LOAD.to_dict(), "schema": "instance_load/1"},
     "instance_ready.schema is 'instance_load/1', but this process reads 'instance_ready/1'"),
])
def test_a_bad_field_is_refused_by_name(record_type, data, message):
    with pytest.raises(ValueError, match=message):
        record_type.from_dict(data)


def test_the_reports_have_schemas_no_other_record_uses():
    schemas = [cls.SCHEMA for cls in WireRecord.__subclasses__()]
    assert InstanceLoad.SCHEMA == "instance_ready/1" and InstanceStats.SCHEMA == "instance_stats/1"
    assert InstanceLoadRecord.SCHEMA == "instance_load/1" and len(schemas) == len(set(schemas))


def test_the_worker_re_exports_the_same_classes():
    assert worker.InstanceLoad is InstanceLoad and worker.InstanceStats is InstanceStats
    assert worker.InstanceState is InstanceState
