"""The workload generator: seeded, sorted, at the fitted rates, with the traces' token counts."""

import itertools
from pathlib import Path

import numpy as np
import pytest

from sim.fit_traces import BUNDLED_FIT, load_trace_fit
from sim.sim_models import model_catalog
from sim.workload import (DEFAULT_REQUESTS_PER_MODEL_PER_HOUR, WorkloadConfig, expected_requests_per_hour,
                          generate_workload, model_services, summarize_workload)

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def _requests(config):
    return list(generate_workload(config, model_catalog(config.num_models, 3)))


def test_bundled_fit_holds_the_sample_as_published():
    fit = load_trace_fit(None)
    functions = fit["azure_functions"]
    assert len(functions["rates_per_bin"]) == 500 and functions["minutes"] == 480
    assert sum(c for pairs in functions["counts"] for _, c in pairs) == 3_037_902  # traces README
    assert max(functions["rates_per_bin"]) * 480 == 1_915_521
    assert len(fit["servegen"]["clients"]) == 421
    services = fit["azure_llm"]["services"]
    assert (services["code"]["requests"], services["conv"]["requests"]) == (8819, 19366)
    assert BUNDLED_FIT.stat().st_size < 200_000


def test_same_seed_same_requests_other_seed_other_requests():
    config = WorkloadConfig(num_models=40, hours=0.5, seed=11)
    a, b = _requests(config), _requests(config)
    assert len(a) > 500 and a == b
    assert a != _requests(WorkloadConfig(num_models=40, hours=0.5, seed=12))


@pytest.mark.parametrize("source", ["azure_functions", "servegen"])
@pytest.mark.parametrize("arrival_process", ["gamma", "poisson"])
def test_sorted_and_inside_the_run(source, arrival_process):
    config = WorkloadConfig(num_models=30, hours=1.25, seed=2, source=source, arrival_process=arrival_process)
    times = [r.arrival_s for r in _requests(config)]
    assert len(times) > 100
    assert times == sorted(times)
    assert times[0] >= 0 and times[-1] < 1.25 * 3600


def test_rates_match_the_fitted_intensity_over_a_long_window():
    config = WorkloadConfig(num_models=200, hours=16, seed=5, requests_per_model_per_hour=20)
    models = model_catalog(200, 3)
    expected = expected_requests_per_hour(config, models)
    # Whole 8-hour segments: the catalog's mean rate is exactly the knob.
    assert np.mean(list(expected.values())) == pytest.approx(20, rel=1e-9)
    summary = summarize_workload(generate_workload(config, models))
    assert summary.total == pytest.approx(20 * 200 * 16, rel=0.02)
    busiest = sorted(expected, key=expected.get, reverse=True)[:5]
    for model_id in busiest:
        assert summary.requests_per_model[model_id] / 16 == pytest.approx(expected[model_id], rel=0.05)
    # Heavy-tailed popularity, as in the functions sample (top 10% of functions: 98.4%).
    rates = np.sort(np.array(list(expected.values())))[::-1]
    assert rates[:20].sum() / rates.sum() > 0.85
    assert np.median(rates) < 0.1 * rates.mean()


def test_default_rate_and_servegen_daily_mean():
    models = model_catalog(100, 3)
    functions = expected_requests_per_hour(WorkloadConfig(num_models=100, hours=8), models)
    assert np.mean(list(functions.values())) == pytest.approx(DEFAULT_REQUESTS_PER_MODEL_PER_HOUR, rel=1e-9)
    servegen = expected_requests_per_hour(WorkloadConfig(num_models=100, hours=24, source="servegen"), models)
    assert np.mean(list(servegen.values())) == pytest.approx(DEFAULT_REQUESTS_PER_MODEL_PER_HOUR, rel=1e-6)


def test_token_quantiles_match_the_azure_llm_trace():
    config = WorkloadConfig(num_models=300, hours=2, seed=9, arrival_process="poisson")
    models = model_catalog(300, 3)
    service = model_services(config, models)
    by = {"code": ([], []), "conv": ([], [])}
    for r in generate_workload(config, models):
        by[service[r.model_id]][0].append(r.input_tokens)
        by[service[r.model_id]][1].append(r.output_tokens)
    assert min(len(by["code"][0]), len(by["conv"][0])) > 5000
    # traces README: code input p50/p90 1469/5194, output p50 13; conv 1020/2735, output p50/p90 129/424.
    for name, inp_p50, inp_p90, out_p50 in (("code", 1469, 5194, 13), ("conv", 1020, 2735, 129)):
        inputs, outputs = np.array(by[name][0]), np.array(by[name][1])
        assert np.quantile(inputs, 0.5) == pytest.approx(inp_p50, rel=0.05)
        assert np.quantile(inputs, 0.9) == pytest.approx(inp_p90, rel=0.05)
        assert np.quantile(outputs, 0.5) == pytest.approx(out_p50, rel=0.1)
        assert inputs.min() >= 1 and outputs.min() >= 1


@pytest.mark.skipif(not (TRACES / "azure_llm_2023_requests.csv.gz").is_file(), reason="raw traces not present")
def test_azure_llm_replays_every_row_once_onto_its_services_models():
    models = model_catalog(2, 0)
    config = WorkloadConfig(num_models=2, hours=3514 / 3600, source="azure_llm", trace_dir=TRACES)
    summary = summarize_workload(generate_workload(config, models))
    service = model_services(config, models)
    counts = {service[m]: n for m, n in summary.requests_per_model.items()}
    assert counts == {"conv": 19366, "code": 8819}
    first = next(iter(generate_workload(config, models)))
    assert (first.arrival_s, first.input_tokens, first.output_tokens) == (0.0, 374, 44)


def test_validation_messages(tmp_path):
    with pytest.raises(ValueError, match="num_models must be an int >= 1"):
        WorkloadConfig(num_models=0, hours=1)
    with pytest.raises(ValueError, match="hours must be a finite number > 0"):
        WorkloadConfig(num_models=1, hours=float("nan"))
    with pytest.raises(ValueError, match=r"source must be one of \('azure_functions', 'servegen', 'azure_llm'\)"):
        WorkloadConfig(num_models=1, hours=1, source="burstgpt")
    with pytest.raises(ValueError, match="requests_per_model_per_hour must be a number > 0 or None"):
        WorkloadConfig(num_models=1, hours=1, requests_per_model_per_hour=0)
    with pytest.raises(ValueError, match="replays the trace's request rows, which are not bundled: set trace_dir"):
        WorkloadConfig(num_models=1, hours=1, source="azure_llm")
    with pytest.raises(ValueError, match=r"num_models is 3 but 2 models were given: build the catalog with model_catalog\(3"):
        generate_workload(WorkloadConfig(num_models=3, hours=1), model_catalog(2, 0))
    with pytest.raises(ValueError, match="not found: point trace_dir"):
        generate_workload(WorkloadConfig(num_models=2, hours=1, trace_dir=tmp_path), model_catalog(2, 0))


def test_streams_lazily():
    config = WorkloadConfig(num_models=5000, hours=24, seed=1)
    first = list(itertools.islice(generate_workload(config, model_catalog(5000, 3)), 10))
    assert len(first) == 10 and first[-1].arrival_s < 60
