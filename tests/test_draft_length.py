"""The batched engine's choice of k: forward costs by size, and the step model per batch size (no clock: fake
times)."""

from __future__ import annotations

import pytest

from verispec.cost_model import CostCurve
from verispec.engine.draft_length import DraftLength


def test_cost_curve_reads_unseen_sizes_off_the_seen_ones() -> None:
    curve = CostCurve(window=3)
    assert curve(4) is None and not curve.near(4)
    for seconds in (1.0, 9.0, 1.2):  # the median shrugs off a stall
        curve.observe(4, seconds)
    curve.observe(8, 2.0)
    curve.observe(16, 1.5)  # noise: a bigger forward never counts as cheaper
    assert curve(4) == pytest.approx(1.2) and curve(2) == pytest.approx(1.2)  # flat below the smallest
    assert curve(6) == pytest.approx(1.6) and curve(16) == pytest.approx(2.0)
    curve.observe(32, 4.0)
    assert curve(48) == pytest.approx(4.0 + 16 * (4.0 - 2.0) / 16)  # the last segment's slope beyond
    # near: a seen size at or below it within a factor of two (above it, past the largest)
    assert curve.near(2) and not curve.near(1) and curve.near(64) and not curve.near(65)


def test_draft_length_times_each_batch_size_once() -> None:
    """Where the steps have not reached a size, forwards of 1 and max_k + 1 tokens per row are timed on the batch;
    their ratio sets r, which decides between drafting and plain decoding. The first step tries the drafter anyway
    (at its most promising k), since nothing is known of it yet."""
    rates, limits = [[0.9] * 4] * 3, [4, 4, 2]
    for slope, first, expected in ((0.02, 4, 4), (1.0, 1, 0)):
        length, widths = DraftLength(4), []

        def measure(n: int) -> float:
            widths.append(n)  # noqa: B023 (called within this iteration)
            return 0.01 * (1 + slope * (3 * n - 3))  # the cost of a forward of 3 rows x n tokens  # noqa: B023

        assert length.choose(rates, limits, measure) == first
        assert sorted(widths) == [1, 5]
        length.observe(3, first, 0.0, first + 1, measure(first + 1), accepted=False)  # a probe, when plain wins
        assert length.choose(rates, limits, measure) == expected
        assert len(widths) == 3  # those sizes are known now
        _, r = length.costs(3, measure)
        assert r(5) == pytest.approx(min(5, 1 + 12 * slope))  # never above 5 forwards of one token
    assert DraftLength(4).choose([[0.9] * 4], [0], measure) == 0  # no room to draft: nothing measured either


def test_bigger_batches_draft_less() -> None:
    """One cost curve for every batch size: memory-bound up to 16 tokens a forward, compute-bound beyond. Drafting
    pays at batch 1 and not at batch 16, where every drafted token costs a target token's compute."""
    length = DraftLength(4)
    for size in (1, 2, 4, 8, 16):
        length.forward.observe(size, 0.01)
    for size in (32, 64, 80):
        length.forward.observe(size, 0.01 * size / 16)
    length.drafting.observe(1, 0.001)
    length.drafting.observe(16, 0.001)
    rates = [0.7] * 4
    length.choose([rates], [4], lambda n: None)  # the first step: a probe whatever the costs
    length.observe(1, 4, 0.004, 5, 0.01, accepted=True)
    chosen = {b: length.choose([rates] * b, [4] * b, lambda n: None) for b in (1, 4, 16)}
    assert chosen[1] == 4 and 0 < chosen[4] < 4 and chosen[16] == 0, chosen
