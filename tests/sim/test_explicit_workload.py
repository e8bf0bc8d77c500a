"""`explicit_workload`: a real run's request list, checked and fed to the simulator as it is --
each request arrives at its own time with its own token counts, in the caller's order."""

import numpy as np
import pytest

from sim import HardwareProfile, ModelTiming, SimConfig, SimRequest, explicit_workload, run_simulation

FAST = ModelTiming(model_id="fast", weight_bytes=1000, prefill_s=0.01, prefill_s_per_token=0.001, decode_step_s=0.002)
SLOW = ModelTiming(model_id="slow", weight_bytes=1000, prefill_s=0.1, prefill_s_per_token=0.01, decode_step_s=0.02)
NODE = HardwareProfile(name="node", num_slots=2, dram_bytes=0, ssd_bytes=1 << 20, dram_Bps=1e9, ssd_Bps=1e9,
                       repository_Bps=1e9, peer_Bps=1e9, spare_start_s=0.0, process_start_s=0.0,
                       request_overhead_s=0.005, models=(FAST, SLOW))


def test_the_requests_are_kept_as_given():
    requests = [SimRequest(0.0, "fast", 3, 2), SimRequest(0.0, "slow", 7, 1), SimRequest(1.5, "fast", 12, 9)]
    assert explicit_workload(iter(requests), ["fast", "slow"]) == requests


@pytest.mark.parametrize("requests, message", [
    ([("fast", 0.0)], "request 0: must be a SimRequest, got tuple"),
    ([SimRequest(-1.0, "fast", 1, 1)], "request 0: arrival_s must be a finite number >= 0, got -1.0"),
    ([SimRequest(float("nan"), "fast", 1, 1)], "request 0: arrival_s must be a finite number >= 0, got nan"),
    ([SimRequest(2.0, "fast", 1, 1), SimRequest(1.0, "fast", 1, 1)],
     "request 1: arrives at 1.0 s, before the request ahead of it (2.0 s); sort the requests by arrival"),
    ([SimRequest(0.0, "other", 1, 1)], "request 0: model 'other' is not in the catalog"),
    ([SimRequest(0.0, "fast", 0, 1)], "request 0: input_tokens must be an integer >= 1, got 0"),
    ([SimRequest(0.0, "fast", 1, 2.0)], "request 0: output_tokens must be an integer >= 1, got 2.0"),
])
def test_a_bad_request_is_refused_with_its_position(requests, message):
    with pytest.raises(ValueError) as raised:
        explicit_workload(requests, ["fast", "slow"])
    assert str(raised.value) == message


def test_each_request_arrives_at_its_time_with_its_tokens():
    # The lower bound serves each request on a warm instance of its own at its arrival: its TTFT is
    # exactly its own prefill (its model, its prompt) plus the request path, so every figure below
    # shows that request's arrival and tokens were fed as given, in order.
    requests = [SimRequest(0.0, "fast", 3, 2), SimRequest(0.5, "slow", 7, 4), SimRequest(0.5, "fast", 20, 1),
                SimRequest(4.25, "slow", 1, 3)]
    config = SimConfig(num_models=2, num_nodes=1, hours=0.01, policy="unbounded", hardware=NODE)
    result = run_simulation(config, requests=explicit_workload(requests, ["fast", "slow"]))
    assert result.num_requests == result.num_served == 4
    expected = [0.01 + 3 * 0.001, 0.1 + 7 * 0.01, 0.01 + 20 * 0.001, 0.1 + 1 * 0.01]
    np.testing.assert_allclose(result.ttft_s, np.array(expected) + 0.005, rtol=0, atol=1e-12)
