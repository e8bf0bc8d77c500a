"""`ModelState`'s queue reports: the oldest and the newest queued request's wait as the gateways
reported them, aged by the time since (issue 39: a preemption saves a deadline only if the
newest request can still meet it), and the controller refusing a report that contradicts itself."""

from __future__ import annotations

import asyncio

import pytest

from controller.model_spec import ModelSpec
from controller.model_state import ModelState
from tests.controller.test_controller import Harness, spec


def test_the_newest_wait_is_the_least_any_gateway_reported_aged_since():
    state = ModelState(spec=ModelSpec.from_dict({"name": "acme/m", "source": "/x"}), repository_name="acme--m",
                       num_desired_instances=0)
    assert state.newest_wait_s(100.0, 10.0) is None  # nothing queued
    state.report_queue("gw1", 3, 100.0, oldest_wait_s=4.0, newest_wait_s=1.0)
    state.report_queue("gw2", 1, 102.0, oldest_wait_s=0.5, newest_wait_s=0.5)
    assert state.newest_wait_s(103.0, 10.0) == pytest.approx(1.5)  # gw2's, 1 s older now
    assert state.oldest_wait_s(103.0, 10.0) == pytest.approx(7.0)  # gw1's, 3 s older now
    state.report_queue("gw2", 0, 104.0)  # gw2's queue emptied: gw1's newest counts
    assert state.newest_wait_s(104.0, 10.0) == pytest.approx(5.0)
    assert state.newest_wait_s(111.0, 10.0) is None  # gw1's report expired


def test_a_report_whose_newest_waited_longer_than_its_oldest_is_refused(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            with pytest.raises(ValueError, match=r"newest_wait_s must be a number from 0 to oldest_wait_s \(1.0\), "
                                                 r"got 2.0"):
                h.controller.notify_demand("acme/m1", 2, "gw", oldest_wait_s=1.0, newest_wait_s=2.0)
            h.controller.notify_demand("acme/m1", 2, "gw", oldest_wait_s=1.0, newest_wait_s=0.25)

    asyncio.run(scenario())
