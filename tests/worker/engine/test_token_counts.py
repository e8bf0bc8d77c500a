"""Tests for worker/engine/token_counts.py: counts grown a step at a time equal counts made at once, the
prompt mask marks the prompt, and ids outside the vocabulary are ignored."""

from __future__ import annotations

import pytest
import torch

from worker.engine.token_counts import TokenCounts


def test_counts_grown_one_token_at_a_time_equal_a_bincount_of_the_output():
    prompt = [3, 3, 9]
    output = [4, 7, 4, 4, 0, 9]
    tokens = list(prompt)
    counts = TokenCounts(12, "cpu")
    for token_id in output:
        tokens.append(token_id)
        counts.update(tokens, start=len(prompt))
    assert counts.output_counts.tolist() == torch.bincount(torch.tensor(output), minlength=12).tolist()
    assert counts.output_counts.dtype == torch.int32 and counts.num_counted == 6
    assert counts.prompt_mask is None
    counts.update(tokens, start=len(prompt))  # nothing new: unchanged
    assert counts.output_counts.tolist() == [1, 0, 0, 0, 3, 0, 0, 1, 0, 1, 0, 0]


def test_several_new_tokens_at_once_and_a_shorter_output_counted_afresh():
    counts = TokenCounts(6, "cpu", [5, 1, 1])
    assert counts.prompt_mask.tolist() == [False, True, False, False, False, True]
    counts.update([2, 2, 3])
    assert counts.output_counts.tolist() == [0, 0, 2, 1, 0, 0]
    counts.update([2])
    assert counts.output_counts.tolist() == [0, 0, 1, 0, 0, 0] and counts.num_counted == 1


def test_ids_outside_the_vocabulary_are_ignored():
    counts = TokenCounts(4, "cpu", [1, 4, 99])
    counts.update([3, 7, -1, 3])
    assert counts.prompt_mask.tolist() == [False, True, False, False]
    assert counts.output_counts.tolist() == [0, 0, 0, 2] and counts.num_counted == 4


def test_a_bad_vocabulary_size_is_refused():
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 1, got 0"):
        TokenCounts(0, "cpu")
