"""Tests for wire/sampling_params.py: defaults, validation messages, normalisation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from wire.sampling_params import SamplingParams


def test_defaults_construct():
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_k == 0
    assert params.top_p == 1.0
    assert params.seed is None
    assert params.stop == ()
    assert params.stop_token_ids == ()
    assert params.ignore_eos is False
    assert params.is_greedy is False


def test_valid_values_are_kept():
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        top_k=40,
        top_p=0.5,
        seed=0,
        stop=("###",),
        stop_token_ids=(0, 7),
        ignore_eos=True,
    )
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (1, 0.0, 40, 0.5)
    assert params.seed == 0
    assert params.stop == ("###",)
    assert params.stop_token_ids == (0, 7)
    assert params.ignore_eos is True


def test_boundary_values_accepted():
    assert SamplingParams(top_p=1.0).top_p == 1.0
    assert SamplingParams(top_p=1e-9).top_p == 1e-9
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(top_k=1).top_k == 1


def test_positional_arguments_refused():
    with pytest.raises(TypeError):
        SamplingParams(16)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", "16"),
        ("max_tokens", None),
        ("temperature", -0.5),
        ("temperature", -1e-12),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", True),
        ("temperature", "1.0"),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_k", False),
        ("top_p", 0.0),
        ("top_p", -0.1),
        ("top_p", 1.0000001),
        ("top_p", math.nan),
        ("top_p", True),
        ("top_p", "0.9"),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.0),
        ("seed", True),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop", 5),
        ("stop", {"a"}),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, 2.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 5),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("presence_penalty", 2.0001),
        ("presence_penalty", -3),
        ("presence_penalty", math.nan),
        ("presence_penalty", "0.5"),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", True),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {1.0: 1.0}),
        ("logit_bias", [(1, 2.0, 3.0)]),
        ("logit_bias", [(1, 1.0), (1, 2.0)]),
        ("logit_bias", 5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens (16)
        ("min_tokens", 1.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", 2.0),
    ],
)
def test_invalid_value_raises_value_error_naming_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"top_k": -1}, "top_k must be 0 (disabled) or an integer >= 1, got -1"),
        ({"seed": -1}, "seed must be None or an integer in [0, 2**64), got -1"),
        ({"stop": ["a", ""]}, "stop[1] must be a non-empty string, got ''"),
        ({"stop_token_ids": [3, -2]}, "stop_token_ids[1] must be an integer >= 0, got -2"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2] (0 is off), got 2.5"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be a number in [-2, 2] (0 is off), got -2.5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0 (1 is off), got 0"),
        ({"min_p": 1.5}, "min_p must be a number in [0, 1] (0 is off), got 1.5"),
        ({"logit_bias": {"7": 101}}, "logit_bias values must be numbers in [-100, 100], got 101 for token 7"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids (integers >= 0), got 'x'"),
        ({"logit_bias": [[1, 2], [3]]}, "logit_bias[1] must be a (token id, bias) pair, got [3]"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be an integer in [0, max_tokens=4], got 5"),
        ({"logprobs": 21},
         "logprobs must be None (off) or an integer in [0, 20] (how many alternatives to report per token), got 21"),
    ],
)
def test_error_messages_are_exact(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value) == message


def test_stop_list_normalised_to_tuple():
    params = SamplingParams(stop=["\n\n", "###"], stop_token_ids=[2, 5])
    assert params.stop == ("\n\n", "###")
    assert type(params.stop) is tuple
    assert params.stop_token_ids == (2, 5)
    assert type(params.stop_token_ids) is tuple


def test_single_stop_string_becomes_one_sequence():
    assert SamplingParams(stop="END").stop == ("END",)


def test_numbers_normalised_to_declared_types():
    params = SamplingParams(temperature=1, top_p=1)
    assert type(params.temperature) is float
    assert type(params.top_p) is float


def test_frozen():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0  # type: ignore[misc]


def test_hashable_and_equal_after_normalisation():
    a = SamplingParams(stop=["x"], stop_token_ids=[1])
    b = SamplingParams(stop=("x",), stop_token_ids=(1,))
    assert a == b
    assert hash(a) == hash(b)


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({}, False),
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"top_k": 1}, True),
        ({"top_k": 1, "temperature": 2.0}, True),
        ({"top_k": 2}, False),
        ({"temperature": 1e-6}, True),  # below MIN_SAMPLING_TEMPERATURE: the argmax (issue 19)
        ({"temperature": 1e-5}, False),
        ({"top_p": 1e-9}, False),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_stop_conditions_are_bounded_so_a_request_cannot_make_every_token_expensive():
    """Issue 19: `stop` had no limit on count or length (they are scanned on every new token)."""
    from wire.sampling_params import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_STOP_TOKEN_IDS

    assert len(SamplingParams(stop=["x"] * MAX_STOP_SEQUENCES).stop) == MAX_STOP_SEQUENCES
    with pytest.raises(ValueError, match=f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got 17"):
        SamplingParams(stop=["x"] * (MAX_STOP_SEQUENCES + 1))
    assert SamplingParams(stop="y" * MAX_STOP_CHARS).stop == ("y" * MAX_STOP_CHARS,)
    with pytest.raises(ValueError, match=r"stop\[1\] may be at most 256 characters, got 257"):
        SamplingParams(stop=["ok", "y" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match=f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))


def test_the_vllm_and_openai_settings_default_to_off_and_keep_their_values():
    off = SamplingParams()
    assert (off.presence_penalty, off.frequency_penalty, off.repetition_penalty, off.min_p, off.logit_bias,
            off.min_tokens, off.logprobs) == (0.0, 0.0, 1.0, 0.0, (), 0, None)
    assert off.has_penalties is False
    params = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1, min_p=1, min_tokens=16,
                            logprobs=0, logit_bias={"50": -100, 3: 100, 9: 0.5})
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == \
        (-2.0, 2.0, 1.0, 1.0)
    assert [type(v) for v in (params.presence_penalty, params.repetition_penalty, params.min_p)] == [float] * 3
    assert params.logit_bias == ((3, 100.0), (9, 0.5), (50, -100.0))
    assert (params.min_tokens, params.logprobs) == (16, 0)
    assert params.has_penalties is True
    assert SamplingParams(repetition_penalty=1.1).has_penalties is True
    assert SamplingParams(frequency_penalty=0.1).has_penalties is True
    # A bias given as a mapping or as pairs is the same record (hashable).
    assert SamplingParams(logit_bias=[(9, 0.5), (3, 100)]) == SamplingParams(logit_bias={3: 100.0, 9: 0.5})
    assert hash(SamplingParams(logit_bias={3: 1})) == hash(SamplingParams(logit_bias=[[3, 1.0]]))


def test_logit_bias_is_bounded():
    from wire.sampling_params import MAX_LOGIT_BIAS_TOKENS

    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS)}).logit_bias) == 1024
    with pytest.raises(ValueError, match="logit_bias may hold at most 1024 tokens, got 1025"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)})
