"""Tests for worker/sampling_params.py: defaults, validation messages, normalisation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from worker.sampling_params import SamplingParams


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
    from worker.sampling_params import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_STOP_TOKEN_IDS

    assert len(SamplingParams(stop=["x"] * MAX_STOP_SEQUENCES).stop) == MAX_STOP_SEQUENCES
    with pytest.raises(ValueError, match=f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got 17"):
        SamplingParams(stop=["x"] * (MAX_STOP_SEQUENCES + 1))
    assert SamplingParams(stop="y" * MAX_STOP_CHARS).stop == ("y" * MAX_STOP_CHARS,)
    with pytest.raises(ValueError, match=r"stop\[1\] may be at most 256 characters, got 257"):
        SamplingParams(stop=["ok", "y" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match=f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
