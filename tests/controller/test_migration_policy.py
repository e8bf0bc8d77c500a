"""`choose_destination`, with plain instances: same model, ready, not the source, not draining;
the least loaded (ties by id); and what an operator is told when there is none."""

from __future__ import annotations

from controller.managed_instance import ManagedInstance
from controller.migration_policy import choose_destination
from wire import InstanceState


def instance(instance_id: str, node_id: str, *, model_id: str = "acme/m1", phase=InstanceState.READY,
             load: int = 0) -> ManagedInstance:
    return ManagedInstance(instance_id, model_id, node_id, "ray", f"thaw-worker-{instance_id}", 1, "acme--m1",
                           phase=phase, num_ongoing_requests=load)


SOURCE = instance("src", "n0")
OTHERS = [SOURCE, instance("busy", "n1", load=5), instance("calm", "n2", load=1), instance("tie", "n2", load=1),
          instance("loading", "n3", phase=InstanceState.LOADING),
          instance("stopping", "n3", phase=InstanceState.STOPPING),
          instance("alien", "n3", model_id="acme/m2"), instance("drained", "n4")]


def chosen(**kwargs) -> tuple[str | None, str]:
    dest, why = choose_destination(SOURCE, OTHERS, {"n4"}, **kwargs)
    return (dest.instance_id if dest else None), why


def test_the_least_loaded_ready_instance_of_the_same_model_outside_draining_nodes():
    assert chosen() == ("calm", "")
    assert chosen(to_node="n1") == ("busy", "")
    assert chosen(to_instance="tie") == ("tie", "")


def test_no_destination_says_why():
    assert chosen(to_node="n3") == (None, "no ready instance of model 'acme/m1' on node n3; scale the model up "
                                          "there first (thaw scale) or name another node")
    assert chosen(to_node="n4") == (None, "node n4 is draining")
    assert chosen(to_instance="loading") == (None, "instance loading is loading, not ready")
    assert chosen(to_instance="drained") == (None, "instance drained is on node n4, which is draining")
    assert chosen(to_instance="alien") == (None, "no instance 'alien' of model 'acme/m1' is running")
    assert chosen(to_instance="src") == (None, "instance src is the source itself")
    alone, why = choose_destination(SOURCE, [SOURCE], set())
    assert alone is None and "no other ready instance of model 'acme/m1'" in why
