"""Tests for controller/model_spec.py: validation messages, names, round trips, files, flags."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import yaml

from controller import (
    AutoscalingPolicy,
    ModelSpec,
    ResourceSpec,
    SpecError,
    add_model_spec_arguments,
    load_model_spec,
    load_model_specs,
    model_spec_from_arguments,
    parse_model_id,
)

FULL = {
    "tenant": "acme",
    "name": "llama-3.1-8b",
    "source": "s3://thaw-models/meta/llama-3.1-8b",
    "dtype": "bfloat16",
    "max_model_len": 8192,
    "kv_cache_bytes": 8 << 30,
    "max_num_seqs": 128,
    "tool_call_parser": "hermes",
    "resources": {"num_cpus": 2.0, "num_gpus": 1.0, "num_worker_slots": 1},
    "autoscaling": {
        "min_instances": 0, "max_instances": 3, "target_ongoing_requests": 4.0, "upscale_delay_s": 0.5,
        "downscale_delay_s": 20.0, "keep_alive_s": 120.0, "keep_alive_per_restart": 15.0, "min_keep_alive_s": 5.0,
        "max_keep_alive_s": 240.0, "max_queued_requests": 32, "queue_timeout_s": 15.0, "priority": 3, "max_wait_before_preempt_s": 2.5, "ttft_slo_s": 4.0,
    },
}


def test_defaults():
    spec = ModelSpec(tenant="acme", name="llama", source="/models/llama")
    assert spec.model_id == "acme/llama"
    assert spec.dtype == "auto" and spec.max_model_len is None and spec.tool_call_parser == "auto"
    assert spec.resources == ResourceSpec(num_cpus=1.0, num_gpus=0.0, num_worker_slots=1)
    assert spec.autoscaling == AutoscalingPolicy(
        min_instances=0, max_instances=1, target_ongoing_requests=2.0, upscale_delay_s=1.0,
        downscale_delay_s=30.0, keep_alive_s=60.0, max_queued_requests=100, queue_timeout_s=60.0,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_round_trip_through_dict_and_json():
    spec = ModelSpec.from_dict(FULL)
    assert spec.to_dict() == FULL
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert ModelSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec


def test_tenant_scoped_name_forms():
    spec = ModelSpec.from_dict({"name": "acme/llama", "source": "/m"})
    assert (spec.tenant, spec.name, spec.model_id) == ("acme", "llama", "acme/llama")
    assert ModelSpec.from_dict({"tenant": "acme", "name": "llama", "source": "/m"}) == spec
    assert parse_model_id("acme/llama") == ("acme", "llama")


def test_partial_sections_take_defaults_and_ints_become_floats():
    spec = ModelSpec.from_dict({"name": "acme/llama", "source": "/m", "autoscaling": {"max_instances": 2,
                                "target_ongoing_requests": 3}, "resources": None})
    assert spec.autoscaling.max_instances == 2
    target = spec.autoscaling.target_ongoing_requests
    assert target == 3.0 and isinstance(target, float)
    assert spec.resources == ResourceSpec()


@pytest.mark.parametrize("name", ["a", "llama-3.1-8b", "qwen2_5", "0model", "x" * 63, "a.b-c_d"])
def test_valid_names(name):
    assert ModelSpec(tenant=name, name=name, source="/m").name == name


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "must not be empty"),
        ("..", "must not contain '..'"),
        ("a..b", "must not contain '..'"),
        ("a/b", "must not contain '/' or '\\'"),
        ("a\\b", "must not contain '/' or '\\'"),
        (".hidden", "starting and ending with a letter or digit"),
        ("-flag", "starting and ending with a letter or digit"),
        ("llama.", "starting and ending with a letter or digit"),
        ("llama-", "starting and ending with a letter or digit"),
        ("Llama", "must be lowercase letters"),
        ("a b", "must be lowercase letters"),
        ("llama\n", "must be lowercase letters"),
        ("x" * 64, "must be at most 63 characters, got 64"),
        (7, "must be a string, got int"),
    ],
)
def test_invalid_names(name, reason):
    with pytest.raises(SpecError) as info:
        ModelSpec(tenant="acme", name=name, source="/m")
    assert info.value.field == "name"
    assert reason in info.value.reason
    with pytest.raises(SpecError) as info:
        ModelSpec(tenant=name, name="llama", source="/m")
    assert info.value.field == "tenant"


@pytest.mark.parametrize(
    ("model_id", "message"),
    [
        ("acme", "tenant: required (or give name as 'tenant/model')"),
        ("acme/x/y", "name: must be 'tenant/model', got 'acme/x/y'"),
        ("../llama", "tenant: must not contain '..', got '..'"),
        ("acme/", "name: must not be empty"),
    ],
)
def test_invalid_model_ids(model_id, message):
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict({"name": model_id, "source": "/m"})
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("/models/llama", "/models/llama"),
        ("/models/llama/", "/models/llama"),
        ("/models/./x/../llama", "/models/llama"),
        ("s3://bucket", "s3://bucket"),
        ("s3://my.bucket-1/prefix/llama-8b", "s3://my.bucket-1/prefix/llama-8b"),
    ],
)
def test_valid_sources(source, expected):
    assert ModelSpec(tenant="a", name="b", source=source).source == expected


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("models/llama", "a local path must be absolute, got 'models/llama'"),
        ("", "must be a local path or s3://bucket/prefix, got ''"),
        ("http://host/x", "unsupported scheme 'http://'; use a local path or s3://bucket/prefix"),
        ("s3://Bad_Bucket/x", "invalid S3 bucket name 'Bad_Bucket'"),
        ("s3://ab/x", "invalid S3 bucket name 'ab'"),
        ("s3://bucket/../other", "S3 prefix must not contain '.' or '..' segments"),
        ("/models/\x00x", "must not contain a NUL character"),
        (None, "must be a local path or s3://bucket/prefix, got None"),
    ],
)
def test_invalid_sources(source, reason):
    with pytest.raises(SpecError) as info:
        ModelSpec(tenant="a", name="b", source=source)
    assert info.value.field == "source"
    assert reason in info.value.reason


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtype": "int8"}, "dtype: must be one of auto, float32, float16, bfloat16, got 'int8'"),
        ({"max_model_len": 0}, "max_model_len: must be >= 1, got 0"),
        ({"max_model_len": 2048.0}, "max_model_len: must be an integer, got 2048.0"),
        ({"kv_cache_bytes": 1000}, "kv_cache_bytes: must be >= 1048576, got 1000"),
        ({"kv_cache_bytes": "4GiB"}, "kv_cache_bytes: must be an integer, got '4GiB'"),
        ({"max_num_seqs": 0}, "max_num_seqs: must be >= 1, got 0"),
        ({"tool_call_parser": "qwen"},
         "tool_call_parser: must be one of auto, none, hermes, llama3_json, mistral, got 'qwen'"),
        ({"resources": {"num_cpus": 0}}, "resources.num_cpus: must be > 0, got 0"),
        ({"resources": {"num_gpus": -1}}, "resources.num_gpus: must be >= 0, got -1"),
        ({"resources": {"num_worker_slots": 0}}, "resources.num_worker_slots: must be >= 1, got 0"),
        ({"autoscaling": {"min_instances": 2, "max_instances": 1}},
         "autoscaling.max_instances: must be >= min_instances (2), got 1"),
        ({"autoscaling": {"min_instances": -1}}, "autoscaling.min_instances: must be >= 0, got -1"),
        ({"autoscaling": {"max_instances": 0}}, "autoscaling.max_instances: must be >= 1, got 0"),
        ({"autoscaling": {"min_instances": True}}, "autoscaling.min_instances: must be an integer, got True"),
        ({"autoscaling": {"target_ongoing_requests": 0}}, "autoscaling.target_ongoing_requests: must be > 0, got 0"),
        ({"autoscaling": {"target_ongoing_requests": float("nan")}},
         "autoscaling.target_ongoing_requests: must be a finite number, got nan"),
        ({"autoscaling": {"upscale_delay_s": -1}}, "autoscaling.upscale_delay_s: must be >= 0, got -1"),
        ({"autoscaling": {"keep_alive_s": "60"}}, "autoscaling.keep_alive_s: must be a finite number, got '60'"),
        ({"autoscaling": {"keep_alive_per_restart": 0}}, "autoscaling.keep_alive_per_restart: must be > 0, got 0"),
        ({"autoscaling": {"min_keep_alive_s": 200.0}},
         "autoscaling.max_keep_alive_s: must be >= min_keep_alive_s (200), got 180"),
        ({"autoscaling": {"max_keep_alive_s": float("inf")}},
         "autoscaling.max_keep_alive_s: must be a finite number, got inf"),
        ({"autoscaling": {"max_queued_requests": 0}}, "autoscaling.max_queued_requests: must be >= 1, got 0"),
        ({"autoscaling": {"queue_timeout_s": 0}}, "autoscaling.queue_timeout_s: must be > 0, got 0"),
        ({"autoscaling": [1, 2]}, "autoscaling: must be a mapping, got list"),
        ({"replicas": 3}, "replicas: unknown field; known fields: tenant, name, source, dtype, max_model_len, "
                          "kv_cache_bytes, max_num_seqs, tool_call_parser, resources, autoscaling"),
        ({"autoscaling": {"max_instnaces": 3}},
         "autoscaling.max_instnaces: unknown field; did you mean 'max_instances'?"),
        ({"resources": {"gpus": 1}}, "resources.gpus: unknown field; did you mean 'num_gpus'?"),
    ],
)
def test_invalid_fields_are_named(changes, message):
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict({**FULL, **changes})
    assert str(info.value) == message


def test_required_fields():
    with pytest.raises(SpecError, match="^source: required$"):
        ModelSpec.from_dict({"name": "acme/llama"})
    with pytest.raises(SpecError, match="^name: required$"):
        ModelSpec.from_dict({"source": "/m"})
    with pytest.raises(SpecError, match=r"^tenant: required \(or give name as 'tenant/model'\)$"):
        ModelSpec.from_dict({"name": "llama", "source": "/m"})
    with pytest.raises(SpecError, match="^spec: must be a mapping, got list$"):
        ModelSpec.from_dict([])  # type: ignore[arg-type]


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)
    error = SpecError("max_instances", "must be >= 1, got 0").within("autoscaling")
    assert (error.field, error.reason, str(error)) == (
        "autoscaling.max_instances", "must be >= 1, got 0", "autoscaling.max_instances: must be >= 1, got 0"
    )


# --- files --------------------------------------------------------------------------------------


def test_load_yaml_and_json_files(tmp_path):
    yaml_path = tmp_path / "llama.yaml"
    yaml_path.write_text(
        "name: acme/llama\n"
        "source: checkpoints/llama   # relative to this file\n"
        "autoscaling:\n"
        "  max_instances: 2\n"
        "  keep_alive_s: 5\n"
    )
    spec = load_model_spec(yaml_path)
    assert spec.model_id == "acme/llama"
    assert spec.source == str(tmp_path / "checkpoints" / "llama")
    assert (spec.autoscaling.max_instances, spec.autoscaling.keep_alive_s) == (2, 5.0)

    json_path = tmp_path / "full.json"
    json_path.write_text(json.dumps(FULL))
    assert load_model_spec(json_path) == ModelSpec.from_dict(FULL)


def test_load_several_specs(tmp_path):
    path = tmp_path / "models.yml"
    path.write_text(yaml.safe_dump({"models": [{"name": "acme/a", "source": "/m/a"},
                                               {"name": "acme/b", "source": "s3://bucket/b"}]}))
    assert [s.model_id for s in load_model_specs(path)] == ["acme/a", "acme/b"]
    with pytest.raises(SpecError, match="expected one model spec, found 2"):
        load_model_spec(path)


def test_file_errors_name_the_file_and_the_entry(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump([{"name": "acme/a", "source": "/m"},
                                    {"name": "acme/b", "source": "/m", "autoscaling": {"max_instances": 0}}]))
    with pytest.raises(SpecError) as info:
        load_model_specs(path)
    assert str(info.value) == f"{path}: models[1].autoscaling.max_instances: must be >= 1, got 0"

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_model_spec(bad_yaml)
    with pytest.raises(SpecError, match="a spec file must end in .yaml, .yml or .json"):
        load_model_spec(tmp_path / "spec.toml")
    with pytest.raises(SpecError, match="cannot read: No such file or directory"):
        load_model_spec(tmp_path / "missing.json")
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(SpecError, match="no model spec in the file"):
        load_model_specs(empty)


# --- flags --------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_spec_arguments(parser)
    return parser.parse_args(argv)


def test_spec_from_flags(tmp_path):
    args = _parse([
        "--name", "acme/llama", "--source", "ckpt", "--dtype", "float16", "--max-model-len", "4096",
        "--num-cpus", "0.5", "--num-worker-slots", "2", "--min-instances", "1", "--max-instances", "3",
        "--target-ongoing-requests", "8", "--upscale-delay-s", "0", "--downscale-delay-s", "5",
        "--keep-alive-s", "10", "--max-queued-requests", "7", "--queue-timeout-s", "2.5",
    ])
    spec = model_spec_from_arguments(args, cwd=tmp_path)
    assert spec == ModelSpec(
        tenant="acme", name="llama", source=str(tmp_path / "ckpt"), dtype="float16", max_model_len=4096,
        resources=ResourceSpec(num_cpus=0.5, num_worker_slots=2),
        autoscaling=AutoscalingPolicy(
            min_instances=1, max_instances=3, target_ongoing_requests=8, upscale_delay_s=0, downscale_delay_s=5,
            keep_alive_s=10, max_queued_requests=7, queue_timeout_s=2.5,
        ),
    )


def test_keep_alive_per_restart_flags():
    spec = model_spec_from_arguments(_parse(["--name", "acme/llama", "--source", "s3://bucket/llama",
                                             "--keep-alive-per-restart", "20", "--min-keep-alive-s", "5",
                                             "--max-keep-alive-s", "120"]))
    assert (spec.autoscaling.keep_alive_per_restart, spec.autoscaling.min_keep_alive_s,
            spec.autoscaling.max_keep_alive_s) == (20.0, 5.0, 120.0)
    assert ModelSpec(tenant="acme", name="x", source="/m").autoscaling.keep_alive_per_restart is None


def test_flags_override_a_base_spec_and_absent_flags_do_not():
    base = ModelSpec.from_dict(FULL)
    spec = model_spec_from_arguments(_parse(["--max-instances", "5"]), base=base)
    assert spec.autoscaling.max_instances == 5
    assert spec == dataclasses.replace(base, autoscaling=dataclasses.replace(base.autoscaling, max_instances=5))
    renamed = model_spec_from_arguments(_parse(["--name", "zeta/other"]), base=base)
    assert (renamed.tenant, renamed.name) == ("zeta", "other")
    assert model_spec_from_arguments(_parse(["--tenant", "zeta", "--name", "x"]), base=base).model_id == "zeta/x"


def test_flag_errors_name_the_flag():
    with pytest.raises(SpecError) as info:
        model_spec_from_arguments(_parse(["--name", "acme/llama", "--source", "/m", "--min-instances", "2",
                                          "--max-instances", "1"]))
    assert str(info.value) == "--max-instances: must be >= min_instances (2), got 1"
    with pytest.raises(SpecError, match="^--name: must be 'tenant/model', got 'a/b/c'$"):
        model_spec_from_arguments(_parse(["--name", "a/b/c", "--source", "/m"]))
    with pytest.raises(SpecError, match="^--source: required$"):
        model_spec_from_arguments(_parse(["--name", "acme/llama"]))


def test_help_shows_plain_metavars_not_internal_dests():
    parser = argparse.ArgumentParser()
    add_model_spec_arguments(parser)
    text = parser.format_help()
    assert "SPEC__" not in text
    assert "--max-wait-before-preempt-s SECONDS" in text
    assert "--kv-cache-bytes BYTES" in text
    assert "--max-instances N" in text
    assert "--source SOURCE" in text
    assert "--num-cpus X" in text
