"""The controller's relay of gateway replicas' per-request metrics: each exchange keeps the
sender's snapshot and returns its live peers'; a replica that stops sending drops out."""

from __future__ import annotations

import pytest

from controller import GatewayMetricsBoard
from wire import GatewayMetricsSnapshot


def snap(replica: str, text: str = "") -> GatewayMetricsSnapshot:
    return GatewayMetricsSnapshot(replica_id=replica, node_id=f"node-{replica}", text=text)


def test_each_exchange_returns_the_other_replicas_latest_snapshots_sorted():
    now = [0.0]
    board = GatewayMetricsBoard(stale_after_s=10.0, clock=lambda: now[0])
    assert board.exchange(snap("b", "b1")) == []
    assert board.exchange(snap("a", "a1")) == [snap("b", "b1")]
    assert board.exchange(snap("b", "b2")) == [snap("a", "a1")]  # b's own never comes back
    assert board.exchange(snap("c")) == [snap("a", "a1"), snap("b", "b2")]
    assert board.replica_ids() == ["a", "b", "c"]


def test_a_replica_that_stops_sending_drops_out_after_the_stale_bound():
    now = [0.0]
    board = GatewayMetricsBoard(stale_after_s=10.0, clock=lambda: now[0])
    board.exchange(snap("gone"))
    now[0] = 10.0
    assert board.exchange(snap("live")) == [snap("gone")]  # at the bound: still there
    now[0] = 10.5
    assert board.exchange(snap("live")) == []
    assert board.replica_ids() == ["live"]


def test_the_board_refuses_what_is_not_a_snapshot_and_a_bad_bound():
    with pytest.raises(ValueError, match="stale_after_s must be > 0"):
        GatewayMetricsBoard(stale_after_s=0)
    with pytest.raises(ValueError, match="must be a GatewayMetricsSnapshot"):
        GatewayMetricsBoard().exchange({"replica_id": "a"})
