"""The lease bookkeeping, with plain numbers for time: what runs out when, in which order, and what
renewing or ending a lease does."""

from __future__ import annotations

import pytest

from migration.lease_book import LeaseBook, validate_lease_s


def test_leases_run_out_at_their_deadline_earliest_first():
    book = LeaseBook()
    book.grant("a", 30.0, now=100.0)
    book.grant("b", 10.0, now=105.0)
    assert book.next_deadline() == 115.0
    assert book.pop_expired(114.9) == []
    assert book.pop_expired(130.0) == [("b", 10.0), ("a", 30.0)]
    assert len(book) == 0 and book.next_deadline() is None


def test_renewing_moves_the_deadline_and_needs_a_lease():
    book = LeaseBook()
    book.grant("a", 30.0, now=0.0)
    assert book.renew("a", 30.0, now=25.0) is True
    assert book.pop_expired(54.9) == [] and book.next_deadline() == 55.0
    assert book.renew("never-granted", 30.0, now=25.0) is False
    assert "never-granted" not in book


def test_ending_a_lease_returns_its_length_once():
    book = LeaseBook()
    book.grant("a", 12.5, now=0.0)
    assert "a" in book
    assert book.end("a") == 12.5
    assert book.end("a") is None
    assert book.pop_expired(1000.0) == []


def test_a_second_grant_replaces_the_first():
    book = LeaseBook()
    book.grant("a", 30.0, now=0.0)
    book.grant("a", 5.0, now=1.0)
    assert len(book) == 1 and book.next_deadline() == 6.0


@pytest.mark.parametrize("lease_s", [0, -1.0, float("inf"), float("nan"), True, "30"])
def test_a_lease_must_be_a_positive_finite_time(lease_s):
    with pytest.raises(ValueError, match="lease_s must be a finite number of seconds > 0"):
        validate_lease_s(lease_s)
    with pytest.raises(ValueError, match="lease_s"):
        LeaseBook().grant("a", lease_s, now=0.0)
