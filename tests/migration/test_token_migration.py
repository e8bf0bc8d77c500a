"""Token-based migration between two running engines: the client sees exactly the unmoved output
(greedy and seeded) wherever the migration starts; a refusing or failing destination leaves the
request finishing on the source, whole, and the destination with every block free."""

from __future__ import annotations

import asyncio
import random

import pytest

from migration import MigrationRefusedError, MigrationStatus, TokenMigrationConfig, migrate_by_tokens
from tests.migration.migration_client import (GREEDY, PROMPTS, SEEDED, FaultyEndpoint, RecordingEndpoint,
                                             stream_following)
from worker import SamplingParams


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_output_with_a_migration_at_a_random_point_equals_the_output_without(
        endpoints, unmoved, params, seed):
    source, dest = endpoints
    prompt = PROMPTS[seed]
    expected = unmoved(prompt, params)
    migrate_after = random.Random(seed).randint(0, 40)
    received = run(stream_following(
        source, {"dst": dest}, "moving", prompt, params, migrate_after=migrate_after,
        migrate=lambda: migrate_by_tokens(source, dest, "moving")))
    outcome = received.outcome
    assert outcome.status is MigrationStatus.MIGRATED, outcome.error
    assert received.num_handoffs == 1 and received.whole == expected.whole
    assert len(received.token_ids) == GREEDY.max_tokens and received.finish_reason == "length"
    assert 1 <= outcome.num_rounds <= 8 and outcome.num_blocks_copied == 0
    assert (outcome.source_id, outcome.destination_id) == ("src", "dst")
    assert outcome.num_tokens_at_stop > migrate_after


def test_the_rounds_stop_at_the_delta_and_the_stop_recomputes_only_what_is_left(endpoints):
    source, dest = endpoints
    watched_source, watched_dest = RecordingEndpoint(source), RecordingEndpoint(dest)
    config = TokenMigrationConfig(max_delta_tokens=2, max_rounds=50)
    # 900 tokens: time for the rounds to converge before the request ends, on a loaded machine too.
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    received = run(stream_following(
        source, {"dst": dest}, "moving", PROMPTS[2], long, migrate_after=5,
        migrate=lambda: migrate_by_tokens(watched_source, watched_dest, "moving", config)))
    outcome = received.outcome
    assert outcome.status is MigrationStatus.MIGRATED, outcome.error
    # One export after each prefill (the first export is the handshake's); the rounds went on while
    # the destination was more than the delta behind, and stopped at the first round within it --
    # or after max_rounds, where the source decodes faster than the destination catches up (a
    # loaded CI machine, once: 50 rounds, never within 2 tokens).
    rounds = list(zip(watched_source.exported[1:], watched_dest.prefilled))
    assert len(rounds) == outcome.num_rounds <= config.max_rounds
    deltas = [num_tokens - 1 - with_kv for num_tokens, with_kv in rounds]
    assert all(d > config.max_delta_tokens for d in deltas[:-1])
    assert deltas[-1] <= config.max_delta_tokens or outcome.num_rounds == config.max_rounds
    # The stop recomputes that last delta plus what the source decoded while the freeze travelled
    # (a few steps, however loaded the machine: not asserted) -- not the whole output.
    [frozen] = watched_source.frozen
    decoded_meanwhile = frozen - watched_source.exported[-1]
    assert decoded_meanwhile >= 0
    assert outcome.num_tokens_after_stop == deltas[-1] + decoded_meanwhile
    assert outcome.num_tokens_after_stop < outcome.num_tokens_at_stop // 4


def test_a_refusing_destination_leaves_the_request_on_the_source(endpoints, unmoved):
    source, dest = endpoints
    expected = unmoved(PROMPTS[3], SEEDED)
    refusing = FaultyEndpoint(dest, "begin_import", MigrationRefusedError("only 0 KV blocks are free"))
    received = run(stream_following(
        source, {"dst": dest}, "moving", PROMPTS[3], SEEDED, migrate_after=10,
        migrate=lambda: migrate_by_tokens(source, refusing, "moving")))
    assert received.outcome.status is MigrationStatus.REFUSED and "0 KV blocks" in received.outcome.error
    assert received.num_handoffs == 0 and received.whole == expected.whole


@pytest.mark.parametrize("method,after_forwarding", [
    ("prefill_import", False),  # the destination dies while catching up: the source never stopped
    ("commit_import", True),  # it dies right after taking the request over: the source had stopped
])
def test_a_destination_failing_mid_migration_leaves_the_request_whole_on_the_source(
        endpoints, unmoved, method, after_forwarding):
    source, dest = endpoints
    expected = unmoved(PROMPTS[4], SEEDED)
    failing = FaultyEndpoint(dest, method, ConnectionError("instance died"), after_forwarding=after_forwarding)
    received = run(stream_following(
        source, {"dst": dest}, "moving", PROMPTS[4], SEEDED, migrate_after=12,
        migrate=lambda: migrate_by_tokens(source, failing, "moving")))
    assert received.outcome.status is MigrationStatus.FAILED and "instance died" in received.outcome.error
    assert received.num_handoffs == 0 and received.whole == expected.whole
    # (the autouse check then finds every block free on both instances)


def test_a_request_that_ended_on_the_source_is_not_migrated(endpoints):
    source, dest = endpoints
    outcome = run(migrate_by_tokens(source, dest, "never-here"))
    assert outcome.status is MigrationStatus.FINISHED and "not on this instance" in outcome.error


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_rounds must be an integer >= 1"):
        TokenMigrationConfig(max_rounds=0)
    with pytest.raises(ValueError, match="max_delta_tokens"):
        TokenMigrationConfig(max_delta_tokens=-1)
