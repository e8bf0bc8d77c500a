"""The first-load floor: its arithmetic, its checks, and that no simulated policy beats it."""

import numpy as np
import pytest

from sim.cost_model import default_cost_model
from sim.sim_models import model_catalog
from sim.simulator import SimConfig, run_simulation
from sim.ttft_floor import first_load_floor_s, percentile_floor_s
from sim.workload import WorkloadConfig, generate_workload


def test_each_request_waits_at_least_the_rest_of_its_models_first_load():
    # model 0 first asked at 10 s, loads in 40 s: ready at 50 s at the earliest
    # model 1 first asked at 0 s, loads in 2 s: ready at 2 s
    arrival = np.array([10.0, 0.0, 30.0, 60.0, 1.5])
    model = np.array([0, 1, 0, 0, 1])
    floors = first_load_floor_s(arrival, model, np.array([40.0, 2.0]))
    np.testing.assert_allclose(floors, [40.0, 2.0, 20.0, 0.0, 0.5])
    assert percentile_floor_s(floors, 99) == 40.0
    assert percentile_floor_s(floors, 50) == 2.0  # "higher": a value some request has, as the run's own P50
    assert np.isnan(percentile_floor_s(np.array([]), 99))


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="1-d and alike"):
        first_load_floor_s(np.zeros(2), np.zeros(3, dtype=int), np.ones(1))
    with pytest.raises(ValueError, match="must index floor_load_s's 1 models"):
        first_load_floor_s(np.zeros(1), np.array([1]), np.ones(1))
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        first_load_floor_s(np.zeros(1), np.array([0]), np.array([-1.0]))


@pytest.mark.parametrize("seed", [5, 6])
@pytest.mark.parametrize("policy,extra", [("thaw", {}), ("thaw", {"thaw_models_per_gpu": 8}),
                                          ("serverlessllm", {}), ("rayserve", {})])
def test_no_policy_serves_a_request_before_its_floor(seed, policy, extra):
    # The contended scenario (`thaw simulate --quick`): every checkpoint starts in the repository.
    models = model_catalog(50, seed)
    requests = list(generate_workload(WorkloadConfig(num_models=50, hours=0.25, seed=seed), models))
    result = run_simulation(SimConfig(num_models=50, num_nodes=2, gpus_per_node=4, hours=0.25, seed=seed,
                                      policy=policy, **extra), models=models, requests=requests)
    cost = default_cost_model()
    index = {m.model_id: i for i, m in enumerate(models)}
    floor_load = np.array([cost.load_s(m.weight_bytes, "s3") + cost.engine_start_s for m in models])
    floors = first_load_floor_s(np.array([r.arrival_s for r in requests]),
                                np.array([index[r.model_id] for r in requests]), floor_load)
    served = ~np.isnan(result.ttft_s)
    assert served.sum() > 600
    assert (result.ttft_s[served] >= floors[served] - 1e-9).all()
    assert np.count_nonzero(floors > 30.0) >= 8  # the floor is no formality: first fetches of 15 GB and more
    assert result.ttft_p99_floor_s == pytest.approx(percentile_floor_s(floors, 99))
    assert result.ttft_p99_s >= result.ttft_p99_floor_s


def test_the_unbounded_reference_has_no_floor_and_staging_lowers_it():
    base = dict(num_models=30, num_nodes=2, gpus_per_node=2, hours=0.1, seed=3)
    assert run_simulation(SimConfig(policy="unbounded", **base)).ttft_p99_floor_s is None
    cold = run_simulation(SimConfig(policy="serverlessllm", **base))
    staged = run_simulation(SimConfig(policy="serverlessllm", staged_tier="dram", **base))
    assert 0 < staged.ttft_p99_floor_s < cold.ttft_p99_floor_s
    assert staged.summary()["ttft_p99_floor_s"] == pytest.approx(staged.ttft_p99_floor_s, abs=1e-6)
