"""Tests for worker/sampler.py: the top-k and top-p filters against plain-Python
references, greedy rows, per-request seeded streams and the sampled distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from worker.sampler import Sampler, apply_top_k, top_p_keep_mask
from worker.sampling_params import SamplingParams


def reference_top_p(probs: list[float], top_p: float) -> set[int]:
    """Sort descending (stable: lower id first on ties), accumulate, keep until >= top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept: set[int] = set()
    cumulative = 0.0
    for token_id in order:
        kept.add(token_id)
        cumulative += probs[token_id]
        if cumulative >= top_p:
            break
    return kept


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw_sequence(sampler, logits_steps, params, seed, companions=()):
    """Sample one row through several steps; `companions` are (logits_fn, params, gen)
    rows placed before it in the batch. Returns the row's tokens."""
    gen = generator(seed)
    tokens = []
    for step, row_logits in enumerate(logits_steps):
        rows = [fn(step) for fn, _, _ in companions] + [row_logits]
        batch = torch.stack(rows)  # [len(companions) + 1, V]
        all_params = [p for _, p, _ in companions] + [params]
        all_gens = [g for _, _, g in companions] + [gen]
        tokens.append(sampler.sample(batch, all_params, all_gens)[-1])
    return tokens


# ---------------------------------------------------------------- apply_top_k


def test_apply_top_k_keeps_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = apply_top_k(logits, 2)
    inf = float("-inf")
    assert out.tolist() == [inf, 5.0, inf, 4.0, inf]
    assert logits.tolist() == [1.0, 5.0, 3.0, 4.0, 2.0]  # input untouched


def test_apply_top_k_per_row_on_2d():
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0], [9.0, 7.0, 8.0, 6.0]])
    inf = float("-inf")
    assert apply_top_k(logits, 3).tolist() == [[inf, 2.0, 1.0, 3.0], [9.0, 7.0, 8.0, inf]]


@pytest.mark.parametrize("k", [0, 5, 6, 1000])
def test_apply_top_k_disabled_is_identity(k):
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    assert apply_top_k(logits, k).tolist() == logits.tolist()


def test_apply_top_k_keeps_ties_with_kth_value():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    inf = float("-inf")
    assert apply_top_k(logits, 3).tolist() == [inf, 3.0, 2.0, 3.0, 2.0]


@pytest.mark.parametrize("k", [-1, 1.5, True])
def test_apply_top_k_rejects_bad_k(k):
    with pytest.raises(ValueError, match="^k must be"):
        apply_top_k(torch.zeros(4), k)


# ---------------------------------------------------------------- top_p_keep_mask

HAND_MADE_CASES = [
    # (probs, top_p, expected kept ids)
    ([0.5, 0.3, 0.2], 0.5, {0}),
    ([0.5, 0.3, 0.2], 0.5000001, {0, 1}),
    ([0.5, 0.3, 0.2], 0.8, {0, 1}),
    ([0.5, 0.3, 0.2], 0.81, {0, 1, 2}),
    ([0.5, 0.3, 0.2], 1.0, {0, 1, 2}),
    ([0.1, 0.6, 0.3], 0.7, {1, 2}),
    ([0.1, 0.6, 0.3], 1e-9, {1}),
    ([0.25, 0.25, 0.25, 0.25], 0.5, {0, 1}),  # ties: lower ids first
    ([0.25, 0.25, 0.25, 0.25], 0.51, {0, 1, 2}),
    ([0.0, 0.0, 1.0, 0.0], 0.99, {2}),
    ([0.0, 0.5, 0.0, 0.5], 1.0, {1, 3}),
    ([0.2, 0.2, 0.6], 0.7, {0, 2}),  # tie at the cut goes to the lower id
    ([1.0], 0.3, {0}),
]


@pytest.mark.parametrize(("probs", "top_p", "expected"), HAND_MADE_CASES)
def test_top_p_hand_made(probs, top_p, expected):
    tensor = torch.tensor(probs, dtype=torch.float32)
    mask = top_p_keep_mask(tensor, top_p)
    assert mask.dtype == torch.bool
    assert mask.shape == tensor.shape
    kept = set(torch.nonzero(mask).flatten().tolist())
    assert kept == expected
    assert kept == reference_top_p(tensor.tolist(), top_p)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_top_p_random_matches_reference(seed, top_p):
    gen = generator(seed)
    vocab_size = [10, 100, 1000, 5000, 50, 3][seed]
    scale = [0.5, 1.0, 3.0, 5.0, 8.0, 1.0][seed]
    probs = torch.softmax(torch.randn(vocab_size, generator=gen) * scale, dim=-1)  # [V]
    if seed == 4:
        probs = torch.round(probs * 20) / 20  # many exact ties and zeros
        probs[0] += 1.0 - probs.sum()
        probs = probs.clamp_min(0.0)
    kept = set(torch.nonzero(top_p_keep_mask(probs, top_p)).flatten().tolist())
    assert kept == reference_top_p(probs.tolist(), top_p)


def test_top_p_2d_is_row_wise():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    assert top_p_keep_mask(probs, 0.7).tolist() == [[True, True, False], [False, True, True]]


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.5, math.nan])
def test_top_p_rejects_out_of_range(top_p):
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\]"):
        top_p_keep_mask(torch.tensor([0.5, 0.5]), top_p)


def test_sampling_with_top_p_stays_in_nucleus():
    probs = torch.tensor([0.02, 0.3, 0.01, 0.25, 0.07, 0.15, 0.2])
    logits = torch.log(probs)
    # Sorted: 1 (.30), 3 (.25), 6 (.20) -> cumulative .75 >= .7; 5, 4, 0, 2 are dropped.
    nucleus = {1, 3, 6}
    assert set(torch.nonzero(top_p_keep_mask(probs, 0.7)).flatten().tolist()) == nucleus
    sampler = Sampler()
    gen = generator(1234)
    num_rows = 500
    params = [SamplingParams(top_p=0.7)] * num_rows
    samples = []
    for _ in range(4):
        samples += sampler.sample(logits.expand(num_rows, -1), params, [gen] * num_rows)
    # Every nucleus token shows up, nothing outside it ever does.
    assert set(samples) == nucleus


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_top_k_1_equals_argmax(dtype):
    sampler = Sampler()
    gen = generator(0)
    logits = (torch.randn(200, 300, generator=gen) * 4).to(dtype)  # [N, V]
    temperatures = [0.05, 0.7, 1.0, 1.5, 10.0]
    params = [SamplingParams(top_k=1, temperature=temperatures[i % 5]) for i in range(200)]
    gens = [generator(i) for i in range(200)]
    assert sampler.sample(logits, params, gens) == logits.argmax(dim=-1).tolist()


def test_top_k_1_filter_then_multinomial_equals_argmax():
    # The filter itself, outside the greedy shortcut: after top-k with k=1 only the argmax
    # has probability mass, whatever the temperature.
    gen = generator(5)
    logits = torch.randn(300, 1000, generator=gen) * 3  # [N, V]
    for temperature in (0.1, 1.0, 7.0):
        probs = torch.softmax(apply_top_k(logits / temperature, 1), dim=-1)  # [N, V]
        drawn = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        assert drawn.tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_mixed_batch_are_exact_argmax():
    sampler = Sampler()
    gen = generator(9)
    num_rows, vocab_size = 32, 2000
    logits = torch.randn(num_rows, vocab_size, generator=gen).to(torch.bfloat16)  # [N, V]
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=1, temperature=3.0),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.9),
    ]
    params = [kinds[i % 4] for i in range(num_rows)]
    gens = [generator(i) if i % 3 else None for i in range(num_rows)]
    tokens = sampler.sample(logits, params, gens)
    argmax = logits.argmax(dim=-1).tolist()
    greedy_rows = [i for i in range(num_rows) if params[i].is_greedy]
    assert len(greedy_rows) == 16
    assert [tokens[i] for i in greedy_rows] == [argmax[i] for i in greedy_rows]
    assert all(0 <= t < vocab_size for t in tokens)
    # At temperature >= 1 over 2000 near-uniform tokens the sampled rows are not argmax.
    sampled_rows = [i for i in range(num_rows) if not params[i].is_greedy]
    assert [tokens[i] for i in sampled_rows] != [argmax[i] for i in sampled_rows]


def test_sampled_rows_respect_top_k():
    sampler = Sampler()
    gen = generator(3)
    logits = torch.randn(64, 500, generator=gen)  # [N, V]
    ks = [2 + i % 5 for i in range(64)]
    params = [SamplingParams(top_k=k, temperature=5.0) for k in ks]
    allowed = [set(torch.topk(logits[i], ks[i]).indices.tolist()) for i in range(64)]
    for step in range(5):
        tokens = sampler.sample(logits, params, [generator(100 * step + i) for i in range(64)])
        assert all(tokens[i] in allowed[i] for i in range(64))


def test_logits_are_not_modified():
    sampler = Sampler()
    logits = torch.randn(4, 50, generator=generator(0))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=5, top_p=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.3),
    ]
    sampler.sample(logits, params, [generator(1), None, None, generator(2)])
    sampler.sample(logits, [params[0]] * 4, [generator(i) for i in range(4)])
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeds


def steps_logits(num_steps: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    gen = generator(seed)
    return [torch.randn(vocab_size, generator=gen) for _ in range(num_steps)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=7),
        SamplingParams(seed=7, temperature=0.8, top_k=40),
        SamplingParams(seed=7, temperature=1.3, top_p=0.9),
        SamplingParams(seed=7, temperature=0.9, top_k=100, top_p=0.8),
    ],
)
def test_seeded_row_is_reproducible_and_independent_of_companions(params):
    sampler = Sampler()
    logits_steps = steps_logits(30, 1000, seed=11)
    alone = draw_sequence(sampler, logits_steps, params, seed=7)
    again = draw_sequence(sampler, logits_steps, params, seed=7)
    assert alone == again

    companion_gen = generator(99)
    companions = [
        (lambda step: torch.randn(1000) * 2, SamplingParams(), None),
        (lambda step: torch.randn(1000), SamplingParams(temperature=0.0), None),
        (lambda step: torch.randn(1000), SamplingParams(top_k=5, top_p=0.5), companion_gen),
        (lambda step: torch.randn(1000), SamplingParams(temperature=0.3, top_k=3), generator(5)),
    ]
    crowded = draw_sequence(sampler, logits_steps, params, seed=7, companions=companions)
    assert crowded == alone

    other_seed = draw_sequence(sampler, logits_steps, params, seed=8)
    assert other_seed != alone


def test_unseeded_rows_use_global_rng():
    sampler = Sampler()
    logits = torch.randn(8, 1000, generator=generator(0))
    params = [SamplingParams(temperature=1.5)] * 8
    torch.manual_seed(2024)
    first = sampler.sample(logits, params, [None] * 8)
    torch.manual_seed(2024)
    second = sampler.sample(logits, params, [None] * 8)
    assert first == second


# ---------------------------------------------------------------- distribution

NUM_DRAWS = 20_000


def empirical_frequencies(params: SamplingParams, probs: list[float], seed: int) -> list[float]:
    sampler = Sampler()
    gen = generator(seed)
    logits = torch.log(torch.tensor(probs)).expand(1000, -1)  # [1000, V]
    counts: Counter[int] = Counter()
    for _ in range(NUM_DRAWS // 1000):
        counts.update(sampler.sample(logits, [params] * 1000, [gen] * 1000))
    return [counts[i] / NUM_DRAWS for i in range(len(probs))]


def tempered(probs: list[float], temperature: float) -> list[float]:
    weights = [p ** (1.0 / temperature) for p in probs]
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.2, 0.5, 0.3]),
        (SamplingParams(temperature=2.0), tempered([0.2, 0.5, 0.3], 2.0)),
        (SamplingParams(temperature=0.5), tempered([0.2, 0.5, 0.3], 0.5)),
        # top-k 2 keeps ids 1 and 2 and renormalises: .5/.8, .3/.8.
        (SamplingParams(top_k=2), [0.0, 0.625, 0.375]),
        # top-p .7: .5 < .7, .5 + .3 >= .7 -> keeps ids 1 and 2, renormalised.
        (SamplingParams(top_p=0.7), [0.0, 0.625, 0.375]),
    ],
)
def test_empirical_distribution(params, expected):
    frequencies = empirical_frequencies(params, [0.2, 0.5, 0.3], seed=42)
    for got, want in zip(frequencies, expected):
        assert abs(got - want) < 0.02, (frequencies, expected)
    if 0.0 in expected:
        assert frequencies[expected.index(0.0)] == 0.0


# ---------------------------------------------------------------- shapes and errors


def test_large_batch_and_vocab():
    sampler = Sampler()
    num_rows, vocab_size = 64, 150_000
    logits = torch.randn(num_rows, vocab_size, generator=generator(0)).to(torch.bfloat16)
    params = [
        [SamplingParams(temperature=0.0), SamplingParams(top_k=50, top_p=0.9), SamplingParams()][
            i % 3
        ]
        for i in range(num_rows)
    ]
    gens = [generator(i) if i % 2 else None for i in range(num_rows)]
    tokens = sampler.sample(logits, params, gens)
    assert len(tokens) == num_rows
    assert all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens)
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in range(0, num_rows, 3)] == argmax[0::3]


def test_empty_batch():
    assert Sampler().sample(torch.empty(0, 10), [], []) == []


def test_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"^logits must be \[N, V\]"):
        Sampler().sample(torch.zeros(10), [SamplingParams()], [None])


@pytest.mark.parametrize(("num_params", "num_gens"), [(1, 2), (2, 1), (3, 3)])
def test_rejects_length_mismatch(num_params, num_gens):
    with pytest.raises(ValueError, match="one SamplingParams and one generator per logits row"):
        Sampler().sample(torch.zeros(2, 10), [SamplingParams()] * num_params, [None] * num_gens)



@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-6, 9.99e-6])
def test_a_temperature_too_small_to_divide_by_samples_greedy_not_nan(temperature):
    """1e-39 passed validation and turned the logits into inf and the softmax into NaN, which
    killed the engine thread (issue 19): below MIN_SAMPLING_TEMPERATURE the row is greedy."""
    from worker.sampling_params import MIN_SAMPLING_TEMPERATURE

    assert temperature < MIN_SAMPLING_TEMPERATURE
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, 0.0, 4.0, 3.99]], dtype=torch.float32)  # [2, V=4]
    params = [SamplingParams(temperature=temperature, seed=1), SamplingParams(temperature=temperature)]
    assert all(p.is_greedy for p in params)
    assert Sampler().sample(logits, params, [generator(1), None]) == [1, 2]


def test_the_smallest_sampling_temperature_still_samples_finitely():
    from worker.sampling_params import MIN_SAMPLING_TEMPERATURE

    params = SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE, seed=3)
    assert not params.is_greedy
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]], dtype=torch.float32) * 1e3  # [1, V=4], large logits
    assert Sampler().sample(logits, [params], [generator(3)]) == [1]  # no NaN: the argmax, effectively
