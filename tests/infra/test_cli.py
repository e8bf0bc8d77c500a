"""The ``thaw`` console script, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

THAW = str(Path(sys.executable).parent / "thaw")


def thaw(*args, timeout=300):
    return subprocess.run([THAW, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "demo"
    result = thaw("demo-model", str(out), "--layers", "2", "--hidden-size", "128")
    assert result.returncode == 0, result.stderr
    assert "random" in result.stderr  # it says the weights are random
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name
    return out


def test_demo_model_refuses_a_non_empty_dir_and_exist_ok_skips(demo_dir):
    again = thaw("demo-model", str(demo_dir))
    assert again.returncode == 2 and "not empty" in again.stderr
    skip = thaw("demo-model", str(demo_dir), "--exist-ok")
    assert skip.returncode == 0 and "already present" in skip.stderr


def test_generate_streams_and_reports(demo_dir):
    result = thaw("generate", str(demo_dir), "Once upon a time", "--max-tokens", "8", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "8 tokens, finish_reason=length" in result.stderr
    assert "loaded demo" in result.stderr
    as_json = thaw("generate", str(demo_dir), "Once upon a time", "--max-tokens", "8", "--ignore-eos", "--json")
    payload = json.loads(as_json.stdout)
    assert payload["num_output_tokens"] == 8 and payload["finish_reason"] == "length"
    assert result.stdout.strip() == payload["text"].strip()  # greedy: the same text both ways


def test_generate_chat_mode(demo_dir):
    result = thaw("generate", str(demo_dir), "hello", "--chat", "--max-tokens", "4", "--json",
                  "--temperature", "0.7", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["num_output_tokens"] <= 4


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["--temperature", "-1"], 2, "temperature must be >= 0"),
        (["--top-p", "0"], 2, "top_p"),
        (["--max-tokens", "0"], 2, "max_tokens"),
        (["--max-tokens", "abc"], 2, "invalid int value"),
    ],
)
def test_generate_bad_flags(demo_dir, args, code, message):
    result = thaw("generate", str(demo_dir), "hi", *args)
    assert result.returncode == code
    assert message in result.stderr


def test_generate_missing_model_and_bad_model(tmp_path):
    missing = thaw("generate", str(tmp_path / "nope"), "hi")
    assert missing.returncode == 1 and "model directory not found" in missing.stderr
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    unsupported = thaw("generate", str(tmp_path), "hi")
    assert unsupported.returncode == 1 and "GPT2LMHeadModel" in unsupported.stderr
    assert "Traceback" not in unsupported.stderr


def test_convert_then_generate_from_the_thaw_format(demo_dir, tmp_path):
    out = tmp_path / "demo-thaw"
    result = thaw("convert", str(demo_dir), str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    assert "converted" in result.stderr and (out / "thaw_index.json").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    from_hf = thaw("generate", str(demo_dir), "Once upon a time", "--max-tokens", "6", "--ignore-eos", "--json")
    from_thaw = thaw("generate", str(out), "Once upon a time", "--max-tokens", "6", "--ignore-eos", "--json")
    assert from_thaw.returncode == 0, from_thaw.stderr
    assert json.loads(from_thaw.stdout)["text"] == json.loads(from_hf.stdout)["text"]
    again = thaw("convert", str(demo_dir), str(out), "--quiet")
    assert again.returncode == 2 and "--overwrite" in again.stderr
    missing = thaw("convert", str(tmp_path / "nope"), str(tmp_path / "x"))
    assert missing.returncode == 2 and "not found" in missing.stderr


@pytest.mark.parametrize("flag, value", [("--spare-workers", "-1"), ("--spare-memory-gb", "-0.5"),
                                         ("--spare-memory-gb", "nan"), ("--peer-link-gbps", "-1"),
                                         ("--peer-link-gbps", "inf")])
def test_serve_refuses_bad_spare_or_stream_settings_by_flag_before_starting_anything(tmp_path, flag, value):
    result = thaw("serve", "--state", str(tmp_path / "state"), flag, value, timeout=60)
    assert result.returncode == 2 and f"{flag} must be 0 or more" in result.stderr
    assert not (tmp_path / "state").exists()  # nothing was set up


def test_serve_refuses_no_auth_on_a_public_host_before_starting_anything(tmp_path):
    result = thaw("serve", "--state", str(tmp_path / "state"), "--no-auth", "--host", "0.0.0.0", timeout=60)
    assert result.returncode == 2
    assert "--no-auth" in result.stderr and "--host must be 127.0.0.1, localhost or ::1, got '0.0.0.0'" in result.stderr
    assert not (tmp_path / "state").exists()


def test_serve_joining_a_cluster_refuses_a_node_local_sqlite_state_before_starting_anything(tmp_path):
    result = thaw("serve", "--state", str(tmp_path / "state"), "--address", "head:6379", timeout=60)
    assert result.returncode == 2
    assert "joining the Ray cluster at head:6379 with the SQLite state store" in result.stderr
    assert "--state-store redis://HOST:6379/0" in result.stderr and "--state-shared" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "state").exists()


def test_serve_names_an_unusable_metrics_token_file_before_starting_anything(tmp_path):
    result = thaw("serve", "--state", str(tmp_path / "state"), "--metrics-token-file", str(tmp_path / "none"),
                  timeout=60)
    assert result.returncode == 1
    assert "--metrics-token-file: cannot read the metrics token file" in result.stderr
    assert "openssl rand -hex 32" in result.stderr
    assert not (tmp_path / "state").exists()


def test_status_table_says_where_each_instance_takes_its_weights_from(capsys):
    from infra.cli_admin import print_status
    base = {"model_id": "acme/m", "node_id": "n1", "state": "ready", "estimate_s": 0.5, "load_s": 0.2,
            "num_ongoing_requests": 0}
    streamed = {**base, "instance_id": "acme--m-2", "tier": None, "weights_resident": False,
                "load_path": {"kind": "stream", "source_instance_id": "acme--m-1", "tier": "repository"}}
    loaded = {**base, "instance_id": "acme--m-1", "tier": "dram", "weights_resident": True,
              "load_path": {"kind": "tier", "source_instance_id": None, "tier": "dram"}}
    print_status({"platform_id": "p", "namespace": "n", "models": [], "instances": [loaded, streamed], "nodes": []})
    out = capsys.readouterr().out
    assert "WEIGHTS FROM" in out and "stream from acme--m-1, arriving" in out
    assert [line for line in out.splitlines() if line.strip().startswith("acme--m-1")][0].split()[4] == "dram"


def test_status_table_shows_a_slot_reclaim_under_way(capsys):
    from infra.cli_admin import print_status
    reclaim = {"model_id": "acme/cold", "node_id": "n0", "tier": "dram", "victim_instance_id": "acme--hot-1",
               "victim_model_id": "acme/hot", "destination_instance_id": "acme--hot-2", "num_requests": 3,
               "cost_s": 1.4, "ready_s": 1.65, "alternative_s": None}
    print_status({"platform_id": "p", "namespace": "n", "models": [], "instances": [], "nodes": [],
                  "slot_reclaims": [reclaim, {**reclaim, "model_id": "acme/other", "alternative_s": 9.5}]})
    out = capsys.readouterr().out
    section = out[out.index("SLOT RECLAIMS"):]
    assert "acme/cold" in section and "acme--hot-1 (acme/hot)" in section and "no room" in section
    assert "9.5" in section
    print_status({"platform_id": "p", "namespace": "n", "models": [], "instances": [], "nodes": []})
    assert "none under way" in capsys.readouterr().out


def test_serve_flags_keep_their_defaults_and_reach_the_controller_config(tmp_path):
    from controller import ControllerConfig
    from infra.cli import build_parser
    from infra.cli_serve import _config_from_args
    from infra.platform_config import GIB, PlatformConfig
    from storage import RepositoryConfig

    state = tmp_path / "state"
    from infra.cli_serve import DEFAULT_SHARED_SLOTS, DEFAULT_WORKER_MEMORY_SHARE, machine_memory_bytes

    config = _config_from_args(build_parser().parse_args(["serve", "--state", str(state)]))
    # The embedded default: a few slots sharing a quarter of the machine's RAM.
    budget = int(machine_memory_bytes() * DEFAULT_WORKER_MEMORY_SHARE / GIB * GIB)
    assert config == PlatformConfig(controller=ControllerConfig(
        state_dir=state, repository=RepositoryConfig(f"{state}/repository"),
        cpu_worker_slots_per_node=DEFAULT_SHARED_SLOTS, worker_memory_bytes=budget))
    assert DEFAULT_SHARED_SLOTS == 4 and abs(budget - machine_memory_bytes() / 4) < 2
    flags = ["serve", "--state", str(state), "--worker-slots", "2", "--ssd-capacity-gb", "2", "--dram-capacity-gb",
             "0.5", "--no-calibrate", "--spare-workers", "0", "--spare-memory-gb", "1", "--peer-link-gbps", "0",
             "--no-slot-sharing", "--namespace", "p2", "--port", "9001", "--gateway-replicas", "2"]
    config = _config_from_args(build_parser().parse_args(flags))
    controller = config.controller
    assert (controller.cpu_worker_slots_per_node, controller.ssd_capacity_bytes, controller.dram_capacity_bytes,
            controller.calibrate, controller.spare_workers_per_node, controller.spare_weight_bytes) == (
        2, 2 * GIB, GIB // 2, False, 0, GIB)
    assert (controller.peer_stream, controller.slot_sharing, controller.namespace) == (None, None, "p2")
    assert (config.port, config.num_gateway_replicas) == (9001, 2)
    assert controller.worker_memory_bytes is None  # --worker-slots alone: slots alone bound a node
    config = _config_from_args(build_parser().parse_args(["serve", "--state", str(state), "--worker-memory-gb", "3"]))
    assert (config.controller.worker_memory_bytes, config.controller.cpu_worker_slots_per_node) == (3 * GIB, 4)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_serve_refuses_a_worker_memory_budget_that_is_not_a_positive_size(tmp_path, value):
    from infra.cli import UsageError, build_parser
    from infra.cli_serve import _config_from_args

    with pytest.raises(UsageError, match=f"--worker-memory-gb must be more than 0 .*got {value}"):
        _config_from_args(build_parser().parse_args(["serve", "--state", str(tmp_path), "--worker-memory-gb", value]))


def test_status_shows_each_nodes_worker_memory(capsys):
    from infra.cli_admin import print_status

    node = {"node_id": "n1", "num_gpus": 0, "num_free_slots": 2, "num_slots": 4, "draining": False, "tiers": [],
            "worker_memory": {"budget_bytes": 4 * 2**30, "used_bytes": 3 * 2**30, "free_bytes": 2**30,
                              "instances": [{"instance_id": "x", "state": "ready"},
                                            {"instance_id": "y", "state": "ready"}]}}
    print_status({"platform_id": "p", "namespace": "n", "models": [], "instances": [], "nodes": [node]})
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("NODE "))
    row = lines[lines.index(header) + 1]
    assert "WORKER MEMORY" in header
    assert row[header.index("WORKER MEMORY"):].startswith("3.2 GB / 4.3 GB (2 inst.)")  # decimal units, as DRAM and SSD
    node["worker_memory"]["instances"][1]["state"] = "asleep"
    print_status({"platform_id": "p", "namespace": "n", "models": [], "instances": [], "nodes": [node]})
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("NODE "))
    assert lines[lines.index(header) + 1][header.index("WORKER MEMORY"):].startswith("3.2 GB / 4.3 GB (2 inst., 1 asleep)")


def test_status_shows_each_nodes_repository_fetches_waiting(capsys):
    from infra.cli_admin import print_status

    node = {"node_id": "n1", "num_gpus": 0, "num_free_slots": 2, "num_slots": 4, "draining": False, "tiers": [],
            "num_fetches_waiting": 3}
    print_status({"platform_id": "p", "namespace": "n", "models": [], "instances": [], "nodes": [node]})
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("NODE "))
    assert lines[lines.index(header) + 1][header.index("FETCHES WAITING"):].strip() == "3"


def test_serve_head_only_without_a_cluster_is_refused_before_starting_anything(tmp_path):
    result = thaw("serve", "--state", str(tmp_path / "state"), "--head-only", timeout=60)
    assert result.returncode == 2
    assert "--head-only needs --address" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "state").exists()


def test_keygen_prints_a_key_in_the_platforms_form_and_serve_refuses_an_empty_admin_key_file(tmp_path):
    import re

    result = thaw("keygen", timeout=60)
    assert result.returncode == 0 and re.fullmatch(r"thaw_[0-9a-f]{16}_[A-Za-z0-9_-]{43}\n", result.stdout)
    assert thaw("keygen", timeout=60).stdout != result.stdout
    (tmp_path / "admin-key").write_text("")
    result = thaw("serve", "--state", str(tmp_path / "state"), "--admin-key-file", str(tmp_path / "admin-key"),
                  timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"--admin-key-file: {tmp_path / 'admin-key'} is empty or missing" in result.stderr


def test_join_refuses_a_bad_resource_or_count_before_starting_anything():
    result = thaw("join", "--address", "head:6379", "--resource", "two words", timeout=60)
    assert result.returncode == 2 and "--resource must be NAME or NAME=AMOUNT (AMOUNT > 0), got 'two words'" in result.stderr
    result = thaw("join", "--address", "head:6379", "--num-gpus", "-1", timeout=60)
    assert result.returncode == 2 and "--num-gpus must be 0 or more" in result.stderr
    assert thaw("join", timeout=60).returncode == 2  # --address is required


def test_status_shows_each_slot_host_with_its_models(capsys):
    from infra.cli_admin import print_status

    host = {"actor_name": "thaw-worker-spare-abc", "ray_node_id": "f" * 56, "warm": True, "memory_bytes": 3 * 10**9,
            "instances": [{"instance_id": "a-1", "model_id": "acme/a", "state": "ready", "memory_bytes": 2 * 10**9,
                           "num_generated_tokens": 40},
                          {"instance_id": "b-1", "model_id": "acme/b", "state": "asleep", "memory_bytes": 10**9,
                           "num_generated_tokens": 8}]}
    print_status({"platform_id": "p", "namespace": "n", "models": [], "instances": [], "nodes": [], "hosts": [host]})
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("HOST "))
    row = lines[lines.index(header) + 1]
    assert row.split()[:4] == ["thaw-worker-spare-abc", "f" * 12, "warm", "3.0"]
    assert row.endswith("acme/a (ready, 40), acme/b (asleep, 8)")
