"""Tests for `verispec.sampling`: parameter validation, logits -> probabilities, and seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from verispec.errors import InvalidArgumentError
from verispec.sampling import GREEDY_TEMPERATURE, LEAST_TOP_P, SamplingParams, logits_to_probs, sample

HAND_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(temperature=-math.inf),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=-0.5),
        dict(top_p=1.0001),
        dict(top_p=math.nan),
    ],
)
def test_invalid_params_raise(kwargs: dict) -> None:
    """Out-of-range temperature, top_k or top_p is refused with InvalidArgumentError."""
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


def test_valid_params_and_greedy_flag() -> None:
    """Temperature 0 (the default) means greedy, and so does one below GREEDY_TEMPERATURE (stored as 0); any larger
    temperature does not."""
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert not SamplingParams(temperature=1.0, top_k=0, top_p=1.0).greedy


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_is_softmax_of_scaled_logits(temperature: float) -> None:
    """With no filters the result is softmax(logits / T), in float32 or wider."""
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, SamplingParams(temperature))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1))
    half = logits_to_probs(logits.half(), SamplingParams(temperature))
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, torch.softmax(logits.half().float() / temperature, -1), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_top_k_keeps_exactly_the_k_largest(k: int) -> None:
    """Top-k zeroes all but the k largest logits and renormalises them as softmax over those k."""
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.9, -0.4, 1.5, 0.0, -2.2]], dtype=torch.float64)
    probs = logits_to_probs(logits, SamplingParams(1.0, top_k=k))[0]
    keep = torch.topk(logits[0], k).indices
    mask = torch.zeros(8, dtype=torch.bool)
    mask[keep] = True
    assert int((probs > 0).sum()) == k
    assert torch.all(probs[~mask] == 0)
    torch.testing.assert_close(probs[mask], torch.softmax(logits[0, mask], -1))
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-12)


def test_top_k_at_or_above_vocab_is_a_no_op() -> None:
    """top_k >= V keeps the whole distribution."""
    logits = torch.tensor([0.1, 0.7, -0.3])
    for k in (3, 10):
        torch.testing.assert_close(logits_to_probs(logits, SamplingParams(1.0, top_k=k)), logits.softmax(-1))


@pytest.mark.parametrize(
    "top_p, kept",
    # cumulative mass of HAND_PROBS is 0.5, 0.8, 0.95, 1: the smallest prefix reaching top_p is kept.
    # (Exact boundaries such as 0.8 are left out: there the answer depends on float round-off.)
    [(1e-9, 1), (0.3, 1), (0.5 - 1e-6, 1), (0.6, 2), (0.79, 2), (0.81, 3), (0.9, 3), (0.96, 4), (1.0, 4)],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, kept: int) -> None:
    """Top-p keeps the most likely tokens until their mass reaches top_p, at least one, and renormalises."""
    order = torch.tensor([2, 0, 3, 1])  # shuffle, so the filter has to sort
    logits = HAND_PROBS.log()[order]
    for dtype in (torch.float32, torch.float64):
        probs = logits_to_probs(logits.to(dtype), SamplingParams(1.0, top_p=top_p)).double()
        expected = HAND_PROBS.clone()
        expected[kept:] = 0
        expected = (expected / expected.sum())[order]
        assert int((probs > 0).sum()) == kept
        torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


def test_temperature_top_k_top_p_compose_on_batched_input() -> None:
    """(B, T, V) logits: temperature, then top-k, then top-p over the top-k renormalised mass, row by row."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64) * 2
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.85)
    probs = logits_to_probs(logits, params)
    assert probs.shape == (2, 3, 6)
    for row_logits, row_probs in zip(logits.reshape(-1, 6), probs.reshape(-1, 6)):
        scaled = row_logits / 0.7
        top = torch.topk(scaled, 4)
        mass = top.values.softmax(-1)  # descending
        kept = int((mass.cumsum(-1) - mass < 0.85).sum())
        expected = torch.zeros(6, dtype=torch.float64)
        expected[top.indices[:kept]] = mass[:kept] / mass[:kept].sum()
        torch.testing.assert_close(row_probs, expected)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, dtype=torch.float64))


def test_sample_is_reproducible_with_a_seeded_generator() -> None:
    """The same seed gives the same tokens; output has the batch shape of `probs`."""
    probs = torch.softmax(torch.randn(4, 5, 10, generator=torch.Generator().manual_seed(2)), -1)
    first = sample(probs, torch.Generator().manual_seed(7))
    second = sample(probs, torch.Generator().manual_seed(7))
    assert first.shape == (4, 5) and first.dtype == torch.long
    assert torch.equal(first, second)
    assert sample(probs[0, 0], torch.Generator().manual_seed(7)).shape == ()
    draws = torch.stack([sample(probs, torch.Generator().manual_seed(s)) for s in range(8)])
    assert not all(torch.equal(draws[0], d) for d in draws[1:])


def test_sample_never_picks_a_zero_probability_token() -> None:
    """Tokens with probability 0 are never drawn."""
    probs = torch.tensor([0.0, 0.6, 0.0, 0.4]).expand(5000, 4)
    tokens = sample(probs, torch.Generator().manual_seed(3))
    assert set(tokens.tolist()) == {1, 3}


def test_sample_empirical_frequencies_match_probs() -> None:
    """Counts over 40,000 draws of one row pass a chi-square test against the row's probabilities."""
    probs = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n = 40_000
    tokens = sample(probs.expand(n, 5), torch.Generator().manual_seed(4))
    counts = torch.bincount(tokens, minlength=5).double()
    result = stats.chisquare(counts.numpy(), (probs.double() * n).numpy())
    assert result.pvalue > 1e-3
    # noise scale of each frequency: sqrt(p(1-p)/n) <= 0.0025
    assert float((counts / n - probs.double()).abs().max()) < 0.01


def test_temperature_zero_is_the_greedy_limit() -> None:
    """logits_to_probs at temperature 0 puts all the mass on the argmax instead of dividing by zero."""
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0]]), SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-40, 1e-20, GREEDY_TEMPERATURE / 2])
def test_a_temperature_that_vanishes_in_float32_samples_the_argmax(temperature: float) -> None:
    """Temperatures that are positive in float64 but 0 (or a denormal) in float32 once divided 0 by 0: now they are
    greedy, and the probabilities are a one-hot on the argmax, never NaN."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    params = SamplingParams(temperature)
    probs = logits_to_probs(logits, params)
    assert params.greedy and torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(4))
    assert torch.equal(sample(probs), logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, LEAST_TOP_P / 2])
def test_a_top_p_that_rounds_to_zero_in_float32_is_refused(top_p: float) -> None:
    with pytest.raises(InvalidArgumentError, match="top_p must be in"):
        SamplingParams(1.0, 0, top_p)


def test_the_least_top_p_keeps_the_top_token_alone() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    probs = logits_to_probs(logits, SamplingParams(1.0, 0, LEAST_TOP_P))
    assert torch.isfinite(probs).all() and torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal((probs > 0).sum(-1), torch.ones(3, dtype=torch.long))
