"""`choose_stream_source` / `choose_load_path` with plain instances: never a loading, stopping,
draining or saturated source; the least busy first, then the new instance's own node; the tier
when it is faster or no peer qualifies, with the reason."""

from __future__ import annotations

import pytest

from controller.managed_instance import ManagedInstance
from controller.stream_source_policy import choose_load_path, choose_stream_source
from wire import InstanceState

MODEL = "acme/m1"


def instance(instance_id: str, node_id: str, *, model_id: str = MODEL, phase=InstanceState.READY,
             load: int = 0, resident: bool = True) -> ManagedInstance:
    return ManagedInstance(instance_id, model_id, node_id, "ray", f"w-{instance_id}", 1, "acme--m1",
                           phase=phase, num_ongoing_requests=load, weights_resident=resident)


def source(instances, node="n0", draining=(), saturated=8):
    chosen, why = choose_stream_source(MODEL, node, instances, set(draining), saturated)
    return (chosen.instance_id if chosen else None), why


def test_the_least_busy_ready_peer_then_the_same_node_then_the_id():
    peers = [instance("busy", "n1", load=5), instance("decode-light", "n2", load=1), instance("idle-far", "n3"),
             instance("idle-near", "n0"), instance("loading", "n0", phase=InstanceState.LOADING)]
    assert source(peers) == ("idle-near", "")
    assert source(peers, node="n9") == ("idle-far", "")
    assert source(peers[:2]) == ("decode-light", "")


@pytest.mark.parametrize("instances, why", [
    ([], "no instance of acme/m1 is running"),
    ([instance("x", "n1", model_id="acme/other")], "no instance of acme/m1 is running"),
    ([instance("l", "n1", phase=InstanceState.LOADING), instance("s", "n2", phase=InstanceState.STOPPING)],
     "no ready instance of acme/m1 to stream from (only loading, stopping ones)"),
    ([instance("d", "n4")], "no ready instance of acme/m1 to stream from (only ready ones)"),
    ([instance("hot", "n1", load=8)], "every ready instance of acme/m1 is saturated (>= 8 ongoing requests)"),
    ([instance("fed", "n1", resident=False)], "every ready instance of acme/m1 is still receiving its own weights"),
])
def test_no_source_says_why(instances, why):
    chosen, reason = source(instances, draining={"n4"})
    assert chosen is None and reason.startswith(why)


def test_load_path_streams_when_a_peer_is_no_slower_than_the_tier():
    peers = [instance("p", "n1", load=2)]
    path = choose_load_path(MODEL, "n0", 10**9, "ssd", 1.0, peers, set(), link_bytes_per_s=2e9, saturated_requests=8)
    assert (path.kind, path.source_instance_id, path.tier) == ("stream", "p", "ssd")
    assert path.estimate_s == pytest.approx(0.5) and "ssd is the fallback" in path.reason
    slow = choose_load_path(MODEL, "n0", 10**9, "dram", 0.1, peers, set(), link_bytes_per_s=2e9, saturated_requests=8)
    assert (slow.kind, slow.source_instance_id, slow.estimate_s) == ("tier", None, 0.1)
    assert slow.reason == "dram 0.1s beats streaming from p (0.5s)"
    none = choose_load_path(MODEL, "n0", 10**9, "repository", 5.0, [], set(), link_bytes_per_s=2e9,
                            saturated_requests=8)
    assert none.kind == "tier" and none.reason == "repository: no instance of acme/m1 is running"
    assert none.to_dict()["kind"] == "tier"
    near = choose_load_path(MODEL, "n1", 10**9, "ssd", 1.0, peers, set(), link_bytes_per_s=2e9, saturated_requests=8)
    assert near.kind == "tier"
    assert near.reason == "ssd: every instance of acme/m1 runs on n1, whose own copy it would send"
    far = choose_load_path(MODEL, "n1", 10**9, "ssd", 1.0, [*peers, instance("q", "n2", load=3)], set(),
                           link_bytes_per_s=2e9, saturated_requests=8)
    assert (far.kind, far.source_instance_id) == ("stream", "q")  # p is less busy, but on n1 itself


@pytest.mark.parametrize("kwargs, match", [
    (dict(link_bytes_per_s=0, saturated_requests=8), "link_bytes_per_s"),
    (dict(link_bytes_per_s=float("inf"), saturated_requests=8), "link_bytes_per_s"),
    (dict(link_bytes_per_s=1e9, saturated_requests=0), "saturated_requests"),
])
def test_bad_numbers_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        choose_load_path(MODEL, "n0", 1, "ssd", 1.0, [instance("p", "n1")], set(), **kwargs)


def test_peer_stream_settings_refuse_what_would_break_a_stream():
    from controller.stream_source_policy import PeerStreamSettings

    assert PeerStreamSettings().stream_config().chunk_bytes == 16 << 20
    for kwargs, field in [({"link_bytes_per_s": 0}, "link_bytes_per_s"), ({"timeout_s": float("inf")}, "timeout_s"),
                          ({"saturated_requests": 0}, "saturated_requests"), ({"chunk_bytes": 1000}, "chunk_bytes")]:
        with pytest.raises(ValueError, match=field):
            PeerStreamSettings(**kwargs)
