"""`QueueOutlooks`: what a waiting request hears, from the controller's last outlook, with numbers alone."""

from __future__ import annotations

import pytest

from controller.slot_outlook import SlotHolder, SlotOutlook
from infra.queue_outlooks import NO_OUTLOOK_LINE, QueueOutlooks

MODEL = "acme/b"
HOLDER = SlotHolder(node_id="n0", instance_id="i-1", model_id="demo/tiny", state="ready", num_ongoing_requests=2)


def test_without_an_outlook_the_generic_line_no_reason_and_the_default_hint():
    outlooks = QueueOutlooks(default_retry_after_s=1.0, max_retry_after_s=60.0)
    assert (outlooks.progress_line(MODEL), outlooks.reason(MODEL)) == (NO_OUTLOOK_LINE, "")
    assert (outlooks.retry_after_s(MODEL), outlooks.cause(MODEL)) == (1.0, "unknown")


def test_an_outlook_gives_the_line_the_reason_the_cause_and_a_rounded_up_hint():
    outlooks = QueueOutlooks(default_retry_after_s=1.0, max_retry_after_s=60.0)
    outlooks.update(MODEL, SlotOutlook(model_id=MODEL, status="waiting_for_slot", position=2, estimate_s=4.2,
                                       holders=(HOLDER,)))
    assert outlooks.progress_line(MODEL) == "waiting for a slot: position 2, about 4.2 s"
    assert outlooks.reason(MODEL) == (": waiting for a slot: position 2, about 4.2 s; slots held by another "
                                      "tenant's model (serving 2); estimated 4.2 s until an instance is ready")
    assert (outlooks.retry_after_s(MODEL), outlooks.cause(MODEL)) == (5.0, "waiting_for_slot")
    assert outlooks.model_ids() == [MODEL] and outlooks.progress_line("acme/other") == NO_OUTLOOK_LINE


@pytest.mark.parametrize("estimate_s, retry_after_s", [(0.0, 1.0), (0.2, 1.0), (1.0, 1.0), (59.01, 60.0),
                                                        (500.0, 60.0), (None, 3.0)])
def test_the_hint_is_whole_seconds_between_one_and_the_cap(estimate_s, retry_after_s):
    outlooks = QueueOutlooks(default_retry_after_s=3.0, max_retry_after_s=60.0)
    outlooks.update(MODEL, SlotOutlook(model_id=MODEL, status="loading", estimate_s=estimate_s))
    assert outlooks.retry_after_s(MODEL) == retry_after_s


def test_none_and_forget_drop_the_outlook():
    outlooks = QueueOutlooks(default_retry_after_s=1.0, max_retry_after_s=60.0)
    outlooks.update(MODEL, SlotOutlook(model_id=MODEL, status="unplaced", reason="no node has 40 GiB free"))
    assert outlooks.progress_line(MODEL) == "waiting: no node has 40 GiB free"
    outlooks.update(MODEL, None)  # the controller had none this time: the old one would only go stale
    assert outlooks.get(MODEL) is None
    outlooks.update(MODEL, SlotOutlook(model_id=MODEL, status="ready", estimate_s=0.0))
    outlooks.forget(MODEL)
    assert outlooks.model_ids() == [] and outlooks.cause(MODEL) == "unknown"


def test_bad_hints_are_refused():
    with pytest.raises(ValueError, match="max_retry_after_s"):
        QueueOutlooks(default_retry_after_s=1.0, max_retry_after_s=0)
