"""Whole runs: the config's checks, determinism for a seed, and `thaw simulate --quick` end to end."""

import json
import math

import numpy as np
import pytest

from infra.cli import main
from sim.policies import ThawAutoscaling
from sim.simulator import SimConfig, run_simulation

SMALL = dict(num_models=30, num_nodes=2, gpus_per_node=2, hours=0.1, seed=3)


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="SimConfig.policy must be one of thaw, serverlessllm, rayserve, unbounded"):
        SimConfig(num_models=1, num_nodes=1, policy="knative")
    with pytest.raises(ValueError, match="SimConfig.num_nodes must be an integer >= 1, got 0"):
        SimConfig(num_models=1, num_nodes=0)
    with pytest.raises(ValueError, match="SimConfig.hours must be a finite number > 0"):
        SimConfig(num_models=1, num_nodes=1, hours=float("inf"))
    with pytest.raises(ValueError, match="SimConfig.gpu must be one of H100, H200, A100"):
        SimConfig(num_models=1, num_nodes=1, gpu="V100")


@pytest.mark.parametrize("policy", ["thaw", "serverlessllm"])
def test_same_seed_same_result(policy):
    first = run_simulation(SimConfig(policy=policy, **SMALL))
    second = run_simulation(SimConfig(policy=policy, **SMALL))
    assert first.num_requests > 100
    np.testing.assert_array_equal(first.ttft_s, second.ttft_s)
    keep = lambda r: {k: v for k, v in r.summary().items() if k not in ("wall_s", "cpu_s", "decision_ms_p50", "decision_ms_p99")}
    assert keep(first) == keep(second)
    other_seed = run_simulation(SimConfig(policy=policy, **{**SMALL, "seed": 4}))
    assert other_seed.num_requests != first.num_requests or not np.array_equal(other_seed.ttft_s, first.ttft_s)


def test_every_request_is_served_and_accounted():
    result = run_simulation(SimConfig(policy="thaw", **SMALL))
    assert result.num_served == result.num_requests
    assert not np.isnan(result.ttft_s).any() and (result.ttft_s > 0).all()
    assert result.cold_starts == sum(result.cold_starts_by_tier.values()) > 0
    assert result.accelerator_s > 0
    assert result.slo_attainment == pytest.approx(np.mean(result.ttft_s <= result.slo_ttft_s))
    assert result.ttft_p50_s == float(np.percentile(result.ttft_s, 50, method="higher"))


def test_thaw_simulate_quick_writes_one_json_line_per_policy_and_the_plots(tmp_path, capsys):
    assert main(["simulate", "--quick", "--json", "--policy", "all", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [line["policy"] for line in lines] == ["thaw", "serverlessllm", "rayserve", "unbounded"]
    for line in lines:
        for key in ("ttft_p50_s", "ttft_p99_s", "slo_attainment", "accelerator_s", "cold_starts",
                    "cold_starts_by_tier", "migrations", "decision_ms_p50"):
            assert key in line
        assert line["num_served"] == line["num_requests"] > 0
    unbounded = lines[3]
    assert unbounded["cold_starts"] == 0 and unbounded["slo_attainment"] == 1.0
    assert all(line["accelerator_s"] > unbounded["accelerator_s"] for line in lines[:3])
    assert lines[2]["cold_starts_by_tier"]["s3"] == lines[2]["cold_starts"]  # rayserve: the repository only
    assert lines[1]["evictions"] == 0 and not math.isnan(lines[0]["ttft_p50_s"])
    written = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert written == lines
    for name in ("ttft_cdf.png", "accelerators.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("policy", ["thaw", "serverlessllm"])
def test_the_cost_models_fast_path_gives_the_unmemoised_runs_figures(policy):
    fast = run_simulation(SimConfig(policy=policy, **SMALL))
    reference = run_simulation(SimConfig(policy=policy, **SMALL), memoise_costs=False)
    assert fast.num_requests > 100
    np.testing.assert_array_equal(fast.ttft_s, reference.ttft_s)
    keep = lambda r: {k: v for k, v in r.summary().items() if k not in ("wall_s", "cpu_s", "decision_ms_p50", "decision_ms_p99")}
    assert keep(fast) == keep(reference)


def test_thaws_slot_sharing_settings_come_from_the_config():
    from controller import SlotSharingSettings
    from controller.eviction_policy import EvictionSettings

    with pytest.raises(ValueError, match="SimConfig.thaw_sharing must be a controller SlotSharingSettings or None, "
                                         "got dict"):
        SimConfig(num_models=1, num_nodes=1, thaw_sharing={"preempt": False})
    with pytest.raises(ValueError, match="SimConfig.thaw_max_wait_before_preempt_s must be a finite number >= 0"):
        SimConfig(num_models=1, num_nodes=1, thaw_max_wait_before_preempt_s=-1)
    default = run_simulation(SimConfig(policy="thaw", **SMALL))
    assert default.settings == {"slot_sharing": True, "min_idle_s": 0.5, "usage_half_life_s": 300.0, "preempt": True,
                                "deadline_preemption": True, "deadline_eviction": True, "lost_wait_s": 60.0,
                                "deadline_order": True, "starvation_bound_s": 300.0, "contended_keep_alive_s": 60.0,
                                "ttft_slo_s": 5.0, "min_run_s": 2.0,
                                "slot_reclaim": True, "max_wait_before_preempt_s": 5.0, "keep_alive_s": 60.0, "keep_alive_per_restart": 30.0,
                                "min_keep_alive_s": 10.0, "max_keep_alive_s": 180.0, "upscale_delay_s": 0.0,
                                "downscale_delay_s": 600.0, "models_per_gpu": 1, "sleep_idle_instances": True}
    with pytest.raises(ValueError, match="ThawAutoscaling.keep_alive_per_restart must be a finite number > 0 or None"):
        ThawAutoscaling(keep_alive_per_restart=0)
    with pytest.raises(ValueError, match="ThawAutoscaling.downscale_delay_s must be a finite number >= 0 or None"):
        ThawAutoscaling(downscale_delay_s=-1)
    with pytest.raises(ValueError, match="SimConfig.thaw_spec must be a sim.policies.ThawAutoscaling, got dict"):
        SimConfig(num_models=1, num_nodes=1, thaw_spec={"keep_alive_per_restart": 20})
    controller = run_simulation(SimConfig(policy="thaw", thaw_spec=ThawAutoscaling.controller_defaults(), **SMALL))
    assert (controller.settings["keep_alive_per_restart"], controller.settings["upscale_delay_s"],
            controller.settings["downscale_delay_s"]) == (None, 1.0, 30.0)
    assert controller.accelerator_s != default.accelerator_s  # the settings reach the policy
    sharing = SlotSharingSettings(eviction=EvictionSettings(min_idle_s=600.0), preempt=False)
    held = run_simulation(SimConfig(policy="thaw", thaw_sharing=sharing, thaw_max_wait_before_preempt_s=30.0, **SMALL))
    assert held.settings["min_idle_s"] == 600.0 and held.settings["preempt"] is False
    assert held.settings["max_wait_before_preempt_s"] == 30.0
    assert held.preemptions == 0 and held.evictions < default.evictions
    assert held.summary()["settings"] == held.settings
    with pytest.raises(ValueError, match="SimConfig.thaw_slot_reclaim must be True or False, got 'no'"):
        SimConfig(num_models=1, num_nodes=1, thaw_slot_reclaim="no")
    assert run_simulation(SimConfig(policy="thaw", thaw_slot_reclaim=False, **SMALL)).settings["slot_reclaim"] is False


def test_thaw_simulate_no_slot_reclaim_reaches_thaws_policy(capsys):
    assert main(["simulate", "--quick", "--policy", "thaw", "--json", "--thaw-no-slot-reclaim"]) == 0
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["settings"]["slot_reclaim"] is False and line["counts"]["slot_reclaims"] == 0


def test_thaw_simulate_no_slot_sharing_reaches_thaws_policy(capsys):
    assert main(["simulate", "--quick", "--policy", "thaw", "--json", "--thaw-no-slot-sharing"]) == 0
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["settings"]["slot_sharing"] is False and line["evictions"] == 0 and line["preemptions"] == 0
    assert main(["simulate", "--quick", "--policy", "thaw", "--thaw-no-slot-sharing", "--thaw-no-preempt"]) == 2
    assert "--thaw-no-slot-sharing turns eviction and preemption off" in capsys.readouterr().err
    with pytest.raises(ValueError, match="SimConfig.thaw_slot_sharing must be True or False, got 'no'"):
        SimConfig(num_models=1, num_nodes=1, thaw_slot_sharing="no")


def test_thaw_simulate_models_per_gpu_makes_thaws_gpus_slot_hosts_and_leaves_the_peers_alone(capsys):
    def run(*flags: str) -> dict[str, dict]:
        assert main(["simulate", "--quick", "--policy", "all", "--json", "--workers", "1", *flags]) == 0
        return {line["policy"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())
                if line}

    alone, hosts = run(), run("--thaw-models-per-gpu", "8")
    assert alone["thaw"]["settings"]["models_per_gpu"] == 1 and hosts["thaw"]["settings"]["models_per_gpu"] == 8
    # Models share GPUs: fewer accelerator-seconds, and no eviction is needed for the first few.
    assert hosts["thaw"]["accelerator_s"] < alone["thaw"]["accelerator_s"]
    assert hosts["thaw"]["evictions"] < alone["thaw"]["evictions"]
    assert hosts["thaw"]["num_served"] == hosts["thaw"]["num_requests"]
    def figures(line: dict) -> dict:  # what was simulated, not how long the simulation took
        return {k: v for k, v in line.items() if k not in ("cpu_s", "wall_s") and not k.startswith("decision_")}

    for peer in ("serverlessllm", "rayserve", "unbounded"):
        assert figures(hosts[peer]) == figures(alone[peer])
    assert main(["simulate", "--quick", "--thaw-models-per-gpu", "0"]) == 2
    assert "thaw_models_per_gpu must be an integer >= 1, got 0" in capsys.readouterr().err


def test_staged_checkpoints_spare_every_first_fetch_for_the_policies_that_keep_node_copies(capsys):
    """`staged_tier`: every node starts with every checkpoint on its SSD (and with "dram" in its
    DRAM as far as it fits), so Thaw and ServerlessLLM-like never read the repository; Ray-Serve-like,
    which keeps no node copies, still does."""
    repository = run_simulation(SimConfig(policy="thaw", **SMALL))
    assert repository.cold_starts_by_tier["s3"] > 0
    for policy in ("thaw", "serverlessllm"):
        for tier in ("ssd", "dram"):
            staged = run_simulation(SimConfig(policy=policy, staged_tier=tier, **SMALL))
            assert staged.cold_starts_by_tier["s3"] == 0 and staged.cold_starts > 0, (policy, tier)
            if tier == "ssd":
                assert staged.cold_starts_by_tier["ssd"] > 0
    assert run_simulation(SimConfig(policy="rayserve", staged_tier="dram", **SMALL)).cold_starts_by_tier["s3"] > 0
    with pytest.raises(ValueError, match="SimConfig.staged_tier must be 'ssd', 'dram' or None, got 'gpu'"):
        SimConfig(num_models=1, num_nodes=1, staged_tier="gpu")
    assert main(["simulate", "--quick", "--policy", "thaw", "--json", "--staged", "ssd"]) == 0
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["cold_starts_by_tier"]["s3"] == 0


def test_thaw_simulate_deadline_flags_reach_thaws_policy(capsys):
    """The issue-39 rules can be turned off one by one (and the lost-request bound changed), so
    the figures before them are reproduced with the same code."""
    assert main(["simulate", "--quick", "--policy", "thaw", "--json", "--thaw-evict-for-lost", "--thaw-order-by-age",
                 "--thaw-lost-wait-s", "30", "--thaw-contended-keep-alive-s", "0"]) == 0
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    settings = line["settings"]
    assert (settings["deadline_eviction"], settings["deadline_order"], settings["lost_wait_s"],
            settings["contended_keep_alive_s"]) == (False, False, 30.0, 0.0)
    assert settings["deadline_preemption"] is True
    assert main(["simulate", "--quick", "--policy", "thaw", "--thaw-lost-wait-s", "-1"]) == 2
    assert "EvictionSettings.lost_wait_s must be a finite number >= 0" in capsys.readouterr().err


def test_policies_run_side_by_side_give_the_figures_of_one_after_another():
    from sim.cli import run_policies

    configs = [SimConfig(policy=name, **{**SMALL, "hours": 0.05}) for name in ("thaw", "serverlessllm", "unbounded")]
    seen = []
    apart = run_policies(configs, lambda index, sim_s: seen.append(index), workers=2)
    together = run_policies(configs, lambda index, sim_s: None, workers=1)
    keep = lambda r: {k: v for k, v in r.summary().items() if k not in ("wall_s", "cpu_s", "decision_ms_p50", "decision_ms_p99")}
    assert [keep(r) for r in apart] == [keep(r) for r in together]
    assert [r.policy for r in apart] == ["thaw", "serverlessllm", "unbounded"]
    for a, b in zip(apart, together):
        np.testing.assert_array_equal(a.ttft_s, b.ttft_s)
    assert set(seen) == {0, 1, 2}  # every run reported its progress back


def test_thaw_simulate_bad_sizes_exit_2_with_the_message(capsys):
    assert main(["simulate", "--models", "0", "--policy", "thaw"]) == 2
    assert "num_models must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["simulate", "--quick", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert main(["simulate", "--quick", "--thaw-downscale-delay-s", "-1"]) == 2
    assert "--thaw-downscale-delay-s must be a finite number >= 0, got -1" in capsys.readouterr().err
    assert main(["simulate", "--quick", "--thaw-keep-alive-per-restart", "nan"]) == 2
    assert "--thaw-keep-alive-per-restart must be a finite number >= 0, got nan" in capsys.readouterr().err
    assert main(["simulate", "--quick", "--short-fetch-ratio", "0.5"]) == 2
    assert "short_fetch_ratio must be 0 (arrival order) or a number >= 1, got 0.5" in capsys.readouterr().err


def test_a_staged_tier_too_small_for_the_catalog_holds_the_most_requested_models():
    from sim.sim_models import SimModel
    from sim.workload import SimRequest

    gib = 1 << 30
    models = [SimModel(model_id=name, family="llama", params_b=8.0, weight_bytes=16 * gib) for name in "abc"]
    # "c" is the most requested, then "b"; the node's DRAM holds two of the three.
    requests = [SimRequest(float(t), "c", 64, 4) for t in range(6)] + [SimRequest(100.0 + t, "b", 64, 4)
                                                                       for t in range(3)]
    requests.append(SimRequest(200.0, "a", 64, 4))
    config = SimConfig(num_models=3, num_nodes=1, gpus_per_node=1, hours=0.1, policy="serverlessllm",
                       staged_tier="dram", dram_gib_per_node=40, keep_alive_s=1.0)
    result = run_simulation(config, models=models, requests=sorted(requests, key=lambda r: r.arrival_s))
    # c and b start from DRAM, a (the least requested, not staged) from the SSD; no staged copy was evicted.
    assert result.cold_starts_by_tier == {**result.cold_starts_by_tier, "dram": 2, "ssd": 1, "s3": 0}


def test_staging_fills_a_tier_in_the_order_given_without_evicting():
    from sim.cluster_spec import ClusterSpec
    from sim.cost_model import H100, default_cost_model
    from sim.event_loop import EventLoop
    from sim.sim_cluster import SimCluster
    from sim.sim_models import SimModel

    gib = 1 << 30
    models = [SimModel(model_id=f"m{i}", family="llama", params_b=b / 2, weight_bytes=b * gib)
              for i, b in enumerate((16, 30, 8, 16))]
    spec = ClusterSpec(num_nodes=1, gpus_per_node=1, dram_bytes_per_node=40 * gib)
    cluster = SimCluster(spec, models, default_cost_model(), H100, EventLoop())
    # m1 (30) first, m3 (16) does not fit the 10 left, m2 (8) does, m0 does not.
    assert cluster.stage(0, [1, 3, 2, 0], "dram") == [1, 2]
    assert cluster.checkpoint_tiers(cluster.nodes[0], 1) == ("dram",)
    assert cluster.checkpoint_tiers(cluster.nodes[0], 3) == ()
    assert cluster.counts["dram_cache_evictions"] == 0
    with pytest.raises(ValueError, match="a node keeps checkpoints in 'dram' or 'ssd', not 'gpu'"):
        cluster.stage(0, [0], "gpu")
