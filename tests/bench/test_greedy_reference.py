"""`bench.greedy_reference`: the verdicts on served tokens (exact, near tie, differs) and the
reference the engine run directly gives."""

from __future__ import annotations

import math

import pytest

from bench.greedy_reference import (GreedyRequest, ReferenceToken, Verdict, judge, near_tie_nats, reference_outputs,
                                    summarize)
from tests.model_factory import make_hf_checkpoint
from worker import Engine, SamplingParams

@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=11)


REFERENCE = (ReferenceToken("a", 2.0), ReferenceToken("c", 0.0, (("d", 0.0), ("f", 0.1))), ReferenceToken("e", math.inf))


def test_the_same_tokens_are_exact():
    assert judge(["a", "c", "e"], REFERENCE, 0.125) == Verdict("exact")


def test_a_first_difference_to_a_token_nearly_as_likely_is_a_near_tie_whatever_follows():
    assert judge(["a", "d", "zzz"], REFERENCE, 0.125) == Verdict("near-tie", 1, 0.0)  # an exact tie
    assert judge(["a", "f", "zzz"], REFERENCE, 0.125) == Verdict("near-tie", 1, 0.1)  # the third, 0.1 nats behind
    assert judge(["a", "f"], REFERENCE, 0.05) == Verdict("differs", 1, 0.0)  # beyond a tighter bound


def test_a_difference_where_the_model_was_sure_or_to_another_token_differs():
    assert judge(["b", "c", "e"], REFERENCE, 0.125) == Verdict("differs", 0, 2.0)  # the runner-up, but 2 nats behind
    assert judge(["a", "x", "e"], REFERENCE, 0.125) == Verdict("differs", 1, 0.0)  # not among the close ones
    assert judge(["a", "c"], REFERENCE, 0.125) == Verdict("differs", 2)  # a token missing
    assert judge(["a", "c", "e", "f"], REFERENCE, 0.125) == Verdict("differs", 3)  # one too many


def test_summary_counts_each_kind_and_the_widest_near_tie():
    verdicts = [Verdict("exact"), Verdict("near-tie", 3, 0.02), Verdict("near-tie", 1, 0.04), Verdict("differs", 0, 1.0)]
    assert summarize(verdicts, "float32") == {
        "num_checked": 4, "exact": 1, "near_ties": 2, "differs": 1, "dtype": "float32", "exact_check": True,
        "near_tie_nats": near_tie_nats("float32"), "widest_near_tie_gap_nats": 0.04}
    assert summarize(verdicts, "bfloat16")["exact_check"] is False  # counts only: see the module docstring


def test_the_reference_is_the_engines_greedy_output_with_its_margins(tiny_llama_dir):
    requests = [GreedyRequest((1, 40, 41, 42), 5), GreedyRequest((1, 300, 7), 3)]
    references = reference_outputs(tiny_llama_dir, requests)
    expected = Engine(tiny_llama_dir).generate(
        [list(r.prompt_token_ids) for r in requests],
        [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, logprobs=1) for r in requests])
    for reference, completion in zip(references, expected):
        assert [t.text for t in reference] == [lp.token for lp in completion.logprobs]
        assert all(t.gap_nats >= 0 for t in reference)  # top-1 minus top-2
        assert all(0 <= gap <= near_tie_nats("bfloat16") for t in reference for _, gap in t.close)
        assert judge([t.text for t in reference], reference, near_tie_nats("float32")) == Verdict("exact")
