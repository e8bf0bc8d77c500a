"""Trace-driven discrete-event simulator of the platform at cluster scale (issue 24).

Public API (everything else in this folder is private to it):
- `SimModel`, `model_catalog`, `ARCHITECTURES`, `SIZE_MIX`: the simulated models, sizes from real
  families (sim_models.py).
- `SimRequest`, `WorkloadConfig`, `WorkloadSummary`, `generate_workload`,
  `expected_requests_per_hour`, `model_services`, `summarize_workload`: request streams from the
  traces of ../shared/traces, fitted by `sim.fit_traces` (workload.py).
- `GpuSpec`, `CostModel`, `H100`, `A100`, `H200`, `default_cost_model`, `LOAD_TIERS`: load,
  prefill, decode and migration times, each constant with its source (cost_model.py).
- `HardwareProfile`, `ModelTiming`: a measured node and its models' engine costs, replacing the
  GPU cost model and catalog in a replay of a real run (hardware_profile.py; its costs through
  `ProfileCostModel`, profile_cost_model.py); `explicit_workload`: that run's exact requests
  (explicit_workload.py).
- `SimConfig`, `SimResult`, `run_simulation`: one run of one policy (simulator.py), on an
  `EventLoop` (event_loop.py) driving a `SimCluster` of `ClusterSpec` shape (sim_cluster.py).
- `POLICY_NAMES`, `PolicySettings`, `SimPolicy`, `make_policy`: the compared policies (policies.py,
  policy_factory.py; thaw_policy.py calls the controller's policy functions unchanged).
- `result_line`, `format_table`, `write_report`: JSON lines, table and plots (report.py);
  `add_simulate_command`: the `thaw simulate` subcommand (cli.py).
"""

from sim.cost_model import A100, H100, H200, LOAD_TIERS, CostModel, GpuSpec, default_cost_model
from sim.sim_models import ARCHITECTURES, SIZE_MIX, SimModel, model_catalog
from sim.cli import add_simulate_command
from sim.explicit_workload import explicit_workload
from sim.hardware_profile import HardwareProfile, ModelTiming
from sim.profile_cost_model import ProfileCostModel
from sim.event_loop import EventLoop
from sim.policies import POLICY_NAMES, PolicySettings, SimPolicy
from sim.policy_factory import make_policy
from sim.report import format_table, result_line, write_report
from sim.cluster_spec import ClusterSpec
from sim.sim_cluster import SimCluster
from sim.simulator import SimConfig, SimResult, run_simulation
from sim.workload import (SimRequest, WorkloadConfig, WorkloadSummary, expected_requests_per_hour, generate_workload,
                          model_services, summarize_workload)

__all__ = [
    "SimModel", "model_catalog", "ARCHITECTURES", "SIZE_MIX",
    "SimRequest", "WorkloadConfig", "WorkloadSummary", "generate_workload", "expected_requests_per_hour",
    "model_services", "summarize_workload",
    "GpuSpec", "CostModel", "H100", "A100", "H200", "default_cost_model", "LOAD_TIERS",
    "HardwareProfile", "ModelTiming", "ProfileCostModel", "explicit_workload",
    "SimConfig", "SimResult", "run_simulation", "EventLoop", "ClusterSpec", "SimCluster",
    "POLICY_NAMES", "PolicySettings", "SimPolicy", "make_policy", "result_line", "format_table", "write_report",
    "add_simulate_command",
]
