"""The Grafana dashboard charts only series the gateway exports, under their exported labels."""

from __future__ import annotations

import json
import re
from pathlib import Path

from infra.gateway_metrics import VLLM_ALIASES, GatewayMetrics
from wire import EngineGauges

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "thaw-dashboard.json"
SERIES = re.compile(r"\b((?:thaw_|vllm:)[a-zA-Z0-9_:]+)(\{[^}]*\})?")


def exported() -> dict[str, set[str]]:
    """Every sample name the gateway's ``/metrics`` shows once each kind of event has happened ->
    the labels it carries (read from the exposition text, as Prometheus would)."""
    metrics = GatewayMetrics()
    metrics.record_request("acme/m", "chat", 200)
    metrics.record_first_token("acme/m", 0.1)
    metrics.record_inter_token("acme/m", 0.01)
    metrics.record_queue_time("acme/m", 0.2)
    metrics.record_finished("acme/m", 1.0, 5, 3)
    metrics.record_cold_start("acme/m", "dram", 0.5)
    metrics.record_queue_wait("acme/m", "loading", "served", 0.5)
    metrics.set_slot_decisions({"evictions": 1})
    metrics.set_instances("acme/m", 1)
    metrics.set_engine_gauges([EngineGauges("i1", "acme/m", "node0", 1, 0, 0.5)])
    names: dict[str, set[str]] = {}
    for line in metrics.render()[0].decode().splitlines():
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        if match and not line.startswith("#"):
            labels = set(re.findall(r'(\w+)="', match.group(2) or ""))
            names.setdefault(match.group(1), set()).update(labels)
    return names


def targets():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"], "the dashboard has no panels"
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} charts nothing"
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def test_every_expression_names_an_exported_series_with_its_labels():
    names = exported()
    seen = set()
    for title, expr in targets():
        found = SERIES.findall(expr)
        assert found, f"{title!r}: no thaw_/vllm: series in {expr!r}"
        for name, selector in found:
            assert name in names, f"{title!r}: {name} is not exported by the gateway"
            for label in re.findall(r"(\w+)\s*=~?", selector):
                assert label in names[name], f"{title!r}: {name} has no label {label!r}"
            seen.add(name)
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for name, _ in found:
                assert set(map(str.strip, label.split(","))) <= names[name], f"{title!r}: grouping by {label}"
    # The dashboard covers what the issue asks for: TTFT, ITL, queue, cold starts by tier, slot
    # decisions, instances per model, KV use.
    assert {"thaw_time_to_first_token_seconds_bucket", "thaw_inter_token_latency_seconds_bucket",
            "thaw_queue_wait_seconds_bucket", "thaw_cold_starts_total", "thaw_slot_decisions",
            "thaw_model_instances", "thaw_engine_requests_running", "thaw_engine_kv_cache_usage"} <= seen


def test_the_vllm_aliases_are_exported_under_vllm_names():
    names = exported()
    for ours, theirs in VLLM_ALIASES.items():
        assert theirs.startswith("vllm:")
        assert any(name.startswith(theirs) for name in names), theirs
        assert any(name.startswith("thaw_" + ours) for name in names), ours
        assert "model_name" in next(labels for name, labels in names.items() if name.startswith(theirs))


def test_the_model_variable_reads_an_exported_label():
    dashboard = json.loads(DASHBOARD.read_text())
    [variable] = dashboard["templating"]["list"]
    assert variable["name"] == "model"
    assert variable["definition"] == "label_values(thaw_gateway_requests_total, model)"
    assert "model" in exported()["thaw_gateway_requests_total"]
