"""Tests for worker/engine/sampler.py: the top-k and top-p filters against plain-Python
references, greedy rows, per-request seeded streams and the sampled distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from worker.engine.sampler import Sampler, apply_top_k, top_p_keep_mask
from wire.sampling_params import SamplingParams


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
    from wire.sampling_params import MIN_SAMPLING_TEMPERATURE

    assert temperature < MIN_SAMPLING_TEMPERATURE
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, 0.0, 4.0, 3.99]], dtype=torch.float32)  # [2, V=4]
    params = [SamplingParams(temperature=temperature, seed=1), SamplingParams(temperature=temperature)]
    assert all(p.is_greedy for p in params)
    assert Sampler().sample(logits, params, [generator(1), None]) == [1, 2]


def test_the_smallest_sampling_temperature_still_samples_finitely():
    from wire.sampling_params import MIN_SAMPLING_TEMPERATURE

    params = SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE, seed=3)
    assert not params.is_greedy
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]], dtype=torch.float32) * 1e3  # [1, V=4], large logits
    assert Sampler().sample(logits, [params], [generator(3)]) == [1]  # no NaN: the argmax, effectively


# ---------------------------------------------------------------- penalties, bias, min-p, min_tokens
#
# References are transformers' logits processors on the same logits and tokens (prompt + output as
# their input_ids). transformers has no OpenAI presence/frequency penalty; its formula is written
# out: logit - frequency_penalty * count_in_output - presence_penalty * (count_in_output > 0).

from transformers.generation.logits_process import (  # noqa: E402 - the references of this section
    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
)

from worker.engine.token_counts import TokenCounts  # noqa: E402

VOCAB = 48
EOS_ID = 0


def random_logits(num_rows: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=generator(seed)) * scale  # [N, V]


def counts_for(params: SamplingParams, prompt: list[int], output: list[int]) -> TokenCounts | None:
    if not params.has_penalties:
        return None
    counts = TokenCounts(VOCAB, "cpu", prompt if params.repetition_penalty != 1.0 else None)
    counts.update(prompt + output, start=len(prompt))
    return counts


def sampler_probs(logits, params, prompts, outputs):
    return Sampler(eos_token_ids=[EOS_ID]).probabilities(
        logits, params, num_output_tokens=[len(o) for o in outputs],
        token_counts=[counts_for(p, pr, o) for p, pr, o in zip(params, prompts, outputs)])


def openai_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).to(torch.float32)  # [V]
    return logits - frequency * counts - presence * (counts > 0).to(torch.float32)


PROMPTS = [[1, 2, 3, 5], [7, 7, 8], [9, 10, 11], [4, 5, 6], [12, 13]]
OUTPUTS = [[5, 14, 14, 15], [3, 3, 9], [], [6, 6, 6, 16], [13, 17]]


def test_each_setting_gives_the_distribution_of_transformers_processors_batched_in_one_call():
    logits = random_logits(5, seed=1)
    params = [
        SamplingParams(repetition_penalty=1.3, temperature=0.7),
        SamplingParams(min_p=0.05, temperature=0.8),
        SamplingParams(logit_bias={5: 3.0, 9: -2.0, 30: 100}),
        SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, temperature=1.5),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0, min_p=0.2,
                       logit_bias={13: -5.0}, temperature=0.5),
    ]
    probs = sampler_probs(logits, params, PROMPTS, OUTPUTS)  # [5, V]

    def ids(row):
        return torch.tensor([PROMPTS[row] + OUTPUTS[row]])

    expected = [
        TemperatureLogitsWarper(0.7)(ids(0), RepetitionPenaltyLogitsProcessor(1.3)(ids(0), logits[0:1])),
        MinPLogitsWarper(0.05)(ids(1), TemperatureLogitsWarper(0.8)(ids(1), logits[1:2])),
        SequenceBiasLogitsProcessor({(5,): 3.0, (9,): -2.0, (30,): 100.0})(ids(2), logits[2:3]),
        TemperatureLogitsWarper(1.5)(ids(3), openai_penalties(logits[3:4], OUTPUTS[3], 0.6, 0.4)),
        # vLLM's order: bias, then repetition, frequency, presence; min-p after temperature.
        MinPLogitsWarper(0.2)(ids(4), TemperatureLogitsWarper(0.5)(ids(4), openai_penalties(
            RepetitionPenaltyLogitsProcessor(0.8)(ids(4), SequenceBiasLogitsProcessor({(13,): -5.0})(
                ids(4), logits[4:5])), OUTPUTS[4], -1.0, 2.0))),
    ]
    for row, reference in enumerate(expected):
        assert torch.equal(probs[row], torch.softmax(reference[0], dim=-1)), f"row {row}"
    # The settings did something: every row differs from the plain softmax at its temperature.
    for row, p in enumerate(params):
        assert not torch.equal(probs[row], torch.softmax(logits[row] / p.temperature, dim=-1)), f"row {row}"
    # min-p kept exactly the tokens at or above min_p x the top probability.
    tempered_probs = torch.softmax(logits[1] / 0.8, dim=-1)
    assert (probs[1] > 0).nonzero().flatten().tolist() == \
        (tempered_probs >= 0.05 * tempered_probs.max()).nonzero().flatten().tolist()
    assert 3 <= int((probs[1] > 0).sum()) < VOCAB


def test_min_p_composes_with_top_k_and_top_p_in_vllm_order():
    logits = random_logits(1, seed=2, scale=1.0)
    params = SamplingParams(min_p=0.3, top_k=6, top_p=0.7, temperature=0.9)
    probs = Sampler().probabilities(logits, [params])[0]
    # temperature -> min-p -> top-k -> softmax -> top-p (renormalised over what is left)
    scaled = MinPLogitsWarper(0.3)(None, logits / torch.tensor(0.9))
    scaled = apply_top_k(scaled, 6)
    kept = torch.softmax(scaled, dim=-1)
    kept = kept.masked_fill(~top_p_keep_mask(kept, 0.7), 0.0)
    assert torch.equal(probs, (kept / kept.sum())[0])


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached_as_transformers_min_new_tokens():
    logits = random_logits(1, seed=3)
    logits[0, EOS_ID] = 50.0  # the model wants to stop now
    logits[0, 7] = 40.0
    params = SamplingParams(min_tokens=3, stop_token_ids=[7], temperature=0.0, max_tokens=8)
    sampler = Sampler(eos_token_ids=[EOS_ID])
    prompt = [1, 2]
    tokens = []
    for num_output in range(5):
        probs = sampler.probabilities(logits, [params], num_output_tokens=[num_output])[0]
        processor = MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos_token_id=[EOS_ID, 7])
        reference = processor(torch.tensor([prompt + [20] * num_output]), logits.clone())[0]
        assert probs.argmax().item() == reference.argmax().item()
        tokens.append(sampler.sample(logits, [params], [None], num_output_tokens=[num_output])[0])
    held = logits.clone()
    held[0, [EOS_ID, 7]] = float("-inf")
    assert tokens[:3] == [held.argmax().item()] * 3 and held.argmax().item() not in (EOS_ID, 7)
    assert tokens[3:] == [EOS_ID, EOS_ID]  # from the fourth token on, EOS may come
    # ignore_eos does not lift it (vLLM holds back every stop id), and no min_tokens holds nothing.
    assert sampler.sample(logits, [SamplingParams(min_tokens=2, ignore_eos=True, temperature=0.0)], [None],
                          num_output_tokens=[1]) != [EOS_ID]
    assert sampler.sample(logits, [SamplingParams(temperature=0.0)], [None]) == [EOS_ID]


def test_greedy_rows_get_penalties_and_bias_too():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, -3.0], [0.0, 5.0, 4.0, 1.0, -3.0], [0.0, 5.0, 4.0, 1.0, -3.0]])
    counts = TokenCounts(5, "cpu", [1])
    counts.update([])
    params = [SamplingParams(temperature=0.0, logit_bias={1: -2}),  # 3.0 < 4.0: token 2
              SamplingParams(temperature=0.0, repetition_penalty=2.0),  # token 1 is in the prompt: 2.5 < 4.0
              SamplingParams(temperature=0.0)]
    assert Sampler().sample(logits, params, [None] * 3, num_output_tokens=[0] * 3,
                            token_counts=[None, counts, None]) == [2, 2, 1]


def test_a_row_without_settings_samples_as_before_beside_rows_with_them():
    steps = steps_logits(6, VOCAB, seed=4)
    plain = SamplingParams(temperature=0.9, seed=5)
    alone = draw_sequence(Sampler(), steps, plain, seed=5)
    busy = SamplingParams(temperature=0.0, logit_bias={3: 10.0}, min_tokens=2)
    counts = TokenCounts(VOCAB, "cpu", [1, 2])
    penalised = SamplingParams(temperature=0.7, repetition_penalty=1.5, frequency_penalty=1.0, min_p=0.1)
    sampler = Sampler(eos_token_ids=[EOS_ID])
    gen = generator(5)
    companion_gen = generator(6)
    together = []
    for row_logits in steps:
        batch = torch.stack([row_logits, row_logits, row_logits])  # [3, V]
        tokens = sampler.sample(batch, [busy, penalised, plain], [None, companion_gen, gen],
                                num_output_tokens=[0, 0, 0], token_counts=[None, counts, None])
        together.append(tokens[-1])
        assert tokens[0] == 3
    assert together == alone


def test_a_penalty_without_its_counts_is_refused_by_row():
    logits = random_logits(2, seed=6)
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0)]
    with pytest.raises(ValueError, match="row 1 has a penalty: pass its TokenCounts over the 48 logits"):
        Sampler().sample(logits, params, [None, None])
    counts = TokenCounts(VOCAB, "cpu")
    with pytest.raises(ValueError, match="row 0 has a repetition penalty: its TokenCounts needs the prompt"):
        Sampler().sample(logits[:1], [SamplingParams(repetition_penalty=1.2)], [None], token_counts=[counts])
    with pytest.raises(ValueError, match="row 0 has min_tokens 2: pass num_output_tokens"):
        Sampler().sample(logits[:1], [SamplingParams(min_tokens=2)], [None])
    with pytest.raises(ValueError, match=r"logit_bias names token 48, outside the model's vocabulary \[0, 48\)"):
        Sampler().sample(logits[:1], [SamplingParams(logit_bias={48: 1.0})], [None])


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_the_logits_given_with_each_rows_top_n():
    logits = random_logits(3, seed=7).to(torch.bfloat16)
    raw = Sampler.logprobs(logits, [4, 11, 0], [0, 2, 5])
    reference = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [3, V]
    for row, (token_id, num_top) in enumerate([(4, 0), (11, 2), (0, 5)]):
        assert raw[row].logprob == pytest.approx(reference[row, token_id].item(), abs=1e-5)
        expected_top = torch.topk(reference[row], num_top).indices.tolist()
        assert raw[row].top_token_ids == expected_top  # random logits: no ties
        assert raw[row].top_logprobs == pytest.approx(reference[row, expected_top].tolist(), abs=1e-5)
        assert raw[row].top_logprobs == sorted(raw[row].top_logprobs, reverse=True)
    assert Sampler.logprobs(logits[:0], [], []) == []
