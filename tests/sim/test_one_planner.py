"""Issue 40: one planner. The controller and the simulator plan each model's tick with the same
function (`controller.model_plan.plan_model`) and carry out what it says.

Recorded here: every (view, time, plan) of a simulated run (Thaw on slot hosts, so instances sleep
and wake) and of a controller run over a fake cluster (scale up, scale down, scale to zero). Each
recorded view replayed through the other side's planner gives the plan its own side made; and
each side's executor did what its plans said: the instances a plan scaled down are no longer
live right after, and no more instances were woken and placed than the plan's missing ones.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import controller.controller as controller_module
import sim.thaw_policy as sim_module
from controller.model_plan import ModelPlan, ModelView
from sim.simulator import SimConfig, run_simulation
from tests.controller.test_controller import Harness, spec


@dataclass(frozen=True)
class Turn:
    view: ModelView
    now: float
    plan: ModelPlan
    live_before: frozenset[str]
    live_after: frozenset[str]


def _recording(module, monkeypatch):
    """Wraps the planner `module` calls, recording each (view, now, plan) it is asked for."""
    real_plan = module.plan_model
    pending: list[tuple[ModelView, float, ModelPlan]] = []

    def plan_model(view, now):
        plan = real_plan(view, now)
        pending.append((view, now, plan))
        return plan

    monkeypatch.setattr(module, "plan_model", plan_model)
    return pending, real_plan


def test_the_simulator_plans_as_the_controller_does(monkeypatch):
    turns: list[Turn] = []
    pending, _ = _recording(sim_module, monkeypatch)
    policy_class = sim_module.ThawPolicy
    real_carry_out = policy_class._carry_out

    def carry_out(self, state, plan, now):
        before = frozenset(i.instance_id for i in state.instances)
        real_carry_out(self, state, plan, now)
        view, at, planned = pending[-1]
        assert planned is plan and at == now
        turns.append(Turn(view, now, plan, before, frozenset(i.instance_id for i in state.instances)))

    monkeypatch.setattr(policy_class, "_carry_out", carry_out)
    run_simulation(SimConfig(policy="thaw", num_models=30, num_nodes=2, gpus_per_node=2, hours=0.1, seed=3,
                             gpu="H100", thaw_models_per_gpu=4))
    assert len(turns) > 50
    assert any(t.plan.scale_down for t in turns) and any(t.plan.wake_order for t in turns)
    assert any(t.plan.num_missing for t in turns)
    for turn in turns:
        assert controller_module.plan_model(turn.view, turn.now) == turn.plan  # the controller's planner
        assert not set(turn.plan.scale_down) & turn.live_after, "a scaled-down instance is still live"
        started = turn.live_after - turn.live_before
        assert len(started) <= turn.plan.num_missing


def test_the_controller_plans_as_the_simulator_does(tmp_path, monkeypatch):
    pending, _ = _recording(controller_module, monkeypatch)
    turns: list[Turn] = []
    real_carry_out = controller_module.Controller._carry_out

    async def carry_out(self, model, plan, now):
        before = frozenset(i.instance_id for i in self._instances.live(model.model_id))
        await real_carry_out(self, model, plan, now)
        view, at, planned = pending[-1]
        assert planned is plan and at == now
        turns.append(Turn(view, now, plan, before,
                          frozenset(i.instance_id for i in self._instances.live(model.model_id))))

    monkeypatch.setattr(controller_module.Controller, "_carry_out", carry_out)

    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), max_instances=2, keep_alive_s=10.0))
            h.controller.notify_demand("acme/m1", 4)
            await h.tick()  # 4 queued: 2 instances
            h.controller.notify_demand("acme/m1", 0)
            busy, idle = h.cluster.live_workers()
            busy.num_ongoing_requests = 1
            await h.tick(1.0)  # 1 request: the idle one goes
            busy.num_ongoing_requests = 0
            await h.tick(5.0)
            await h.tick(10.0)  # idle past the keep-alive: to zero
            h.controller.notify_demand("acme/m1", 1)
            await h.tick(1.0)  # a cold start again

    asyncio.run(scenario())
    counts = [t.plan.num_desired_instances for t in turns]
    assert counts[0] == 2 and 1 in counts and 0 in counts and counts[-1] == 1
    assert any(t.plan.scale_down for t in turns)
    for turn in turns:
        assert sim_module.plan_model(turn.view, turn.now) == turn.plan  # the simulator's planner
        assert not set(turn.plan.scale_down) & turn.live_after, "a scaled-down instance is still live"
        assert len(turn.live_after - turn.live_before) <= turn.plan.num_missing



def test_only_the_planner_calls_the_autoscaler():
    """The count is decided in one place: no other module calls `decide` (a second caller would be
    a second planner, as sim/thaw_policy.py was)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    callers = set()
    for folder in ("controller", "sim", "infra", "bench"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                    if name == "decide":
                        callers.add(path.relative_to(root).as_posix())
    assert callers == {"controller/model_plan.py"}
