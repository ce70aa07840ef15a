"""Adaptive draft length: the choice against the step model's formula, the estimates, the probing schedule, and the
loop with `auto` (greedy identity, stopping on a draft that never agrees, drafting all it may on one that always
does, sampling's distribution kept)."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import pytest

from drafting import OwnSession, last_two_of_four
from test_verify import P_VALUE_MIN, compare
from verispec import generate
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cost_model import (
    PROBE_BUDGET,
    PROBE_FIRST,
    PROBE_MAX,
    PROBE_WAIT_MAX,
    Acceptance,
    Timings,
    best_k,
    expected_tokens,
)
from verispec.drafters.adaptive import AUTO_MAX_K, AdaptiveK
from verispec.drafters.base import Proposal, Verdict
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.registry import Method, Resources, build_drafter
from verispec.models.native import load_model

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32, 100, 101, 102]
N = 48

pytestmark = pytest.mark.usefixtures("single_thread")


def brute_force(a: Sequence[float], c: float, r, limit: int) -> int:
    speeds = [1.0] + [
        (1 + sum(np.prod(a[:i]) for i in range(1, k + 1))) / (k * c + r(k + 1)) for k in range(1, limit + 1)
    ]
    return int(np.argmax(speeds))  # the first (smallest) k on a tie


@pytest.mark.parametrize(
    "a, c, slope, limit",
    [
        ([0.9] * 8, 0.1, 0.05, 8),
        ([0.9] * 8, 0.1, 0.2, 8),
        ([0.6, 0.5, 0.4, 0.4], 0.1, 0.1, 4),
        ([0.2] * 8, 0.1, 0.1, 8),
        ([0.0] * 8, 0.0, 0.0, 8),
        ([1.0] * 8, 0.0, 0.0, 8),
        ([0.95] * 8, 0.3, 0.0, 8),
        ([0.7, 0.9, 0.9, 0.9], 0.05, 0.02, 3),
        ([0.5] * 6, 0.02, 0.3, 6),
    ],
)
def test_best_k_maximises_the_formula(a, c, slope, limit) -> None:
    r = lambda n: 1 + slope * (n - 1)
    assert best_k(a, c, r, range(limit + 1)) == brute_force(a, c, r, limit)


def test_best_k_by_hand() -> None:
    r = lambda n: 1.0 + 0.1 * (n - 1)
    assert expected_tokens([0.5, 0.5], 2) == 1.75
    # k=1: 1.5 / 1.2 = 1.25; k=2: 1.75 / 1.4 = 1.25 (a tie: the smaller); k=3: 1.875 / 1.6
    assert best_k([0.5] * 3, 0.1, r, range(4)) == 1
    # k=1: 1.9 / 1.15 = 1.65; k=2: 2.71 / 1.3 = 2.08; k=3: 3.439 / 1.45 = 2.37; k=4: 4.095 / 1.6 = 2.56
    assert best_k([0.9] * 4, 0.05, lambda n: 1.0, range(5)) == 4
    assert best_k([0.05] * 4, 0.1, r, range(5)) == 0  # 1.05 / 1.2 < 1: plain decoding
    assert best_k([0.15], 0.0, lambda n: 1.1, range(2)) == 1 and best_k([0.05], 0.0, lambda n: 1.1, range(2)) == 0
    # a tree or window: its configured width, or nothing
    assert best_k([0.9] * 3, 0.0, lambda n: 1 + 0.1 * (n - 1), (0, 3), lambda k: 12 if k else 0) == 1 * 3
    assert best_k([0.3] * 3, 0.0, lambda n: 1 + 0.1 * (n - 1), (0, 3), lambda k: 12 if k else 0) == 0


def test_acceptance_counts_only_positions_tried() -> None:
    est = Acceptance(4, prior=0.5, weight=1.0, decay=1.0)
    est.observe(drafted=4, accepted=1)  # position 1 kept, 2 rejected, 3 and 4 never judged
    assert est.tried == [1, 1, 0, 0] and est.hits == [1, 0, 0, 0]
    rates = est.rates()
    assert rates[0] == pytest.approx(0.75) and rates[1] == pytest.approx(0.75 / 2)
    assert rates[2] == rates[3] == pytest.approx(rates[1])  # untried depths look like the deepest tried
    fresh = Acceptance(2, decay=0.5)
    for _ in range(20):
        fresh.observe(2, 0)
    assert fresh.rates()[0] < 0.25  # a few steps move it: old counts fade
    for _ in range(4):
        fresh.observe(2, 2)
    assert fresh.rates()[0] > 0.75


def test_timings_fit_a_line_and_take_medians() -> None:
    t = Timings()
    c, r, start = t.costs()  # nothing measured: the priors
    assert c == pytest.approx(0.1) and r(3) == pytest.approx(1.2) and start == 0
    for seconds in (0.030, 0.010, 0.011, 0.5, 0.010, 0.009):  # one stall: the median ignores it
        t.observe(0, 0.0, 1, seconds)
    for seconds in (0.060, 0.020, 0.020, 0.021):  # a width's first timing (one-time work) is left out
        t.observe(4, 0.004, 5, seconds)
    assert list(t.verify[1]) == [0.010, 0.011, 0.5, 0.010, 0.009] and list(t.verify[5]) == [0.020, 0.020, 0.021]
    c, r, start = t.costs()  # one draft length timed: all its cost taken as drafting's start
    assert c == 0 and start == pytest.approx(0.4) and r(1) == 1 and r(5) == pytest.approx(2.0)
    assert r(3) == pytest.approx(1.5)
    assert r(9) == pytest.approx(2.4)  # past the widest seen, no steeper than the prior slope (the line says 3.0)
    narrow = Timings()  # float32's costly 2-token forward must not price the untried wider ones out
    for width, seconds in ((1, 0.010), (2, 0.0138)) * 2:
        narrow.observe(width - 1, 0.0, width, seconds)
    assert narrow.costs()[1](5) == pytest.approx(1.38 + 3 * 0.1)
    only_wide = Timings()
    for _ in range(2):
        only_wide.observe(4, 0.0, 5, 0.014)
    assert only_wide.costs()[1](5) == pytest.approx(1.4)  # one width: the prior slope prices the others
    first = Timings()  # a width timed once: its first forward, left out (a capture costs about three replays)
    first.observe(8, 0.0, 9, 0.090)
    assert not first.verify


class Never(OwnSession):
    """Proposes tokens no target would take (the verdict is faked by `run`) and records each k asked."""

    name = "never"

    def __init__(self, k: int = 8) -> None:
        self.k = self.width = k
        self.asked: list[int] = []

    def propose(self, context, k: int) -> Proposal:
        self.asked.append(k)
        return Proposal([0] * k)

    def accepted(self, verdict) -> None:
        pass


def test_probing_schedule_backs_off_while_probes_fail() -> None:
    inner = Never()
    session = AdaptiveK(inner, costs=(0.1, lambda n: 1.0 + 0.05 * (n - 1))).begin(None)
    asked = []
    for _ in range(400):
        session.propose([1, 2, 3], 8)
        asked.append(inner.asked[-1])
        session.accepted(Verdict([]))
    first_plain = asked.index(0)
    assert first_plain <= 6  # a few rejections stop it
    probes = [i for i in range(first_plain, len(asked)) if asked[i]]
    assert all(asked[i] == 1 for i in probes)
    gaps = [b - a - 1 for a, b in zip([first_plain - 1] + probes, probes)]
    # plain steps between probes: PROBE_FIRST, then twice as many after each failed probe, up to PROBE_MAX, and
    # never fewer than keep a probe's predicted extra cost (0.1 + r(2) - 1 = 0.15 of a step) under PROBE_BUDGET
    budget = 0.15 / PROBE_BUDGET
    expected = [int(max(min(PROBE_FIRST * 2**i, PROBE_MAX), budget)) for i in range(len(gaps))]
    assert expected[:5] == [15, 15, 16, 32, 64]
    assert gaps == expected
    assert sum(asked[first_plain:]) / len(asked[first_plain:]) < 0.03  # a few percent of a token per step


def test_a_probe_that_succeeds_brings_drafting_back() -> None:
    inner = Never()
    session = AdaptiveK(inner, costs=(0.05, lambda n: 1.0)).begin(None)
    agree = False
    for step in range(200):
        session.propose([1, 2, 3], 8)
        k = inner.asked[-1]
        agree = agree or step >= 60  # the drafter starts agreeing at step 60
        session.accepted(Verdict(list(range(k)) if agree else []))
    assert inner.asked[:60].count(0) > 30
    assert inner.asked[-20:] == [8] * 20


@pytest.fixture(scope="module")
def truth(target) -> list[int]:
    return generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens


def test_greedy_identity_with_auto(target, draft, unrelated, truth) -> None:
    for model in (draft, unrelated, target):
        for k in (1, 3, 8):
            out = generate(target, PROMPT, AdaptiveK(DraftModel(model, k)), max_new_tokens=N, ignore_eos=True)
            assert out.tokens == truth
            assert sum(out.stats.steps_by_depth) == out.stats.target_calls
            assert len(out.stats.steps_by_depth) <= k + 1


def test_auto_stops_drafting_with_a_draft_that_never_agrees(target, unrelated) -> None:
    out = generate(
        target,
        PROMPT,
        build_drafter(Method("draft", "auto"), Resources(draft=unrelated)),
        max_new_tokens=96,
        ignore_eos=True,
    )
    steps = out.stats.steps_by_depth
    assert out.stats.accepted <= 2
    assert steps[0] >= 0.9 * sum(steps)  # plain steps, counted, not timed
    assert sum(steps[2:]) <= 3  # at most the first few steps draft more than one


def test_auto_drafts_the_most_when_the_draft_is_always_right(target, truth) -> None:
    # With the target as its own draft c is about 1, which never pays; the costs here are a cheap draft's.
    out = generate(
        target, PROMPT, AdaptiveK(DraftModel(target, 8), costs=(0.05, lambda n: 1.0)), max_new_tokens=N, ignore_eos=True
    )
    assert out.tokens == truth
    steps = out.stats.steps_by_depth
    assert steps[8] >= out.stats.target_calls - 4  # after the first few, every step drafts all eight


def test_registry_builds_auto() -> None:
    method = Method("draft", "auto")
    assert method.label == "draft k=auto"
    drafter = build_drafter(Method("ngram", "auto"))
    assert isinstance(drafter, AdaptiveK) and drafter.k == AUTO_MAX_K and drafter.chain
    window = build_drafter(Method("lookahead", "auto", {"window": 3, "ngram": 3, "candidates": 3}))
    assert isinstance(window, AdaptiveK) and not window.chain and window.k == 2


# ---------------------------------------------------------------------------------------------------------------
# sampling: k is chosen from past verdicts only, so each step is a fixed-k step and the distribution is the target's

VOCAB, SAMPLE_PROMPT, DRAWS, NEW = 6, [1, 4, 2], 3000, 4


class Successor(OwnSession):
    """One-hot proposals last + 1, last + 2, ...: accepted with the target's probability of those tokens."""

    name = "successor"

    def __init__(self, k: int) -> None:
        self.k = self.width = k

    def propose(self, context, k: int) -> Proposal:
        return Proposal([(context[-1] + 1 + i) % VOCAB for i in range(k)])

    def accepted(self, verdict) -> None:
        pass


def test_sampling_with_auto_follows_the_target(tmp_path, reference_probs) -> None:
    """Four tokens sampled with `auto` (costs fixed so that k moves between 0, 1 and 2 with the verdicts): the
    last two tokens, whose steps' k depended on earlier verdicts, are distributed as under the target."""
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    folder = random_checkpoint(tmp_path / "target", config, seed=1)
    target = load_model(folder)
    last_two = last_two_of_four(folder, SAMPLE_PROMPT, VOCAB, reference_probs)
    drafter = AdaptiveK(Successor(2), costs=(0.3, lambda n: 1.0))
    counts, ks = np.zeros((VOCAB, VOCAB)), set()
    for seed in range(DRAWS):
        out = generate(target, SAMPLE_PROMPT, drafter, max_new_tokens=NEW, temperature=1.0, seed=seed, ignore_eos=True)
        counts[out.tokens[2], out.tokens[3]] += 1
        ks.add(tuple(out.stats.steps_by_depth))
    assert len(ks) > 2  # the steps' lengths did vary with the verdicts
    pvalue, tv = compare(counts.ravel(), last_two.ravel())
    assert pvalue > P_VALUE_MIN and tv < (last_two.size / DRAWS) ** 0.5, (pvalue, tv)


def test_a_depth_left_untried_drifts_back_to_the_one_before() -> None:
    est = Acceptance(4, decay=0.9)
    est.observe(drafted=4, accepted=3)  # depth 4 fails once...
    assert est.rates()[3] < 0.5
    for _ in range(30):  # ...then only 3 deep is drafted, always accepted
        est.observe(drafted=3, accepted=3)
    rates = est.rates()
    assert rates[3] > 0.85 * rates[2] and rates[2] > 0.9  # so drafting 4 deep pays again
    assert best_k(rates, 0.05, lambda n: 1.0, range(5)) == 4


def test_drafting_is_priced_as_a_start_and_a_cost_per_token() -> None:
    """A draft model's chain costs mostly its first forward: by the cost per token of one k alone, drafting 2 would
    look twice as dear a token as drafting 4, and a short k would keep choosing itself. A k's first timing is left
    out and the fastest of the rest is taken: each of the first two may include a capture."""
    t = Timings()
    for _ in range(3):
        t.observe(0, 0.0, 1, 0.010)
    assert t.drafting() is None and t.costs()[0] == pytest.approx(0.1)  # the prior
    for k, seconds in ((2, 0.030), (2, 0.0030), (4, 0.030), (4, 0.0034), (4, 0.034), (8, 0.040), (8, 0.0042)):
        t.observe(k, seconds, k + 1, 0.011)
    assert t.drafting() == (pytest.approx(0.0034), 0.0)  # only k = 4 timed twice: all of it the start
    t.observe(2, 0.0030, 3, 0.011)
    start, per_token = t.drafting()
    assert start == pytest.approx(0.0026) and per_token == pytest.approx(0.0002)
    c, r, s = t.costs()
    assert c == pytest.approx(0.02) and s == pytest.approx(0.26)
    rates = [0.8] * 8
    assert best_k(rates, c, lambda n: 1.0, range(9), start=s) == 8
    assert best_k(rates, 0.0030 / 2 / 0.010, lambda n: 1.0, range(9)) < 8  # priced by k = 2's cost per token
    assert best_k([0.2] * 8, c, lambda n: 1.0, range(9), start=s) == 0  # the start alone outweighs 1.2 tokens


def test_a_probes_price_includes_draftings_start() -> None:
    """Drafting that costs mostly its start (a draft model's chain; a tree's whole proposal) makes probes dear: they
    come no more often than keeps their predicted cost, the start included, under PROBE_BUDGET."""
    inner = Never()
    session = AdaptiveK(inner, costs=(0.0, lambda n: 1.0 + 0.05 * (n - 1), 0.4)).begin(None)
    for _ in range(400):
        session.propose([1, 2, 3], 8)
        session.accepted(Verdict([]))
    probes = [i for i, k in enumerate(inner.asked) if k]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert len(gaps) >= 3 and min(gaps[1:]) == int((0.4 + 0.05) / PROBE_BUDGET)


class CatchingUp(Never):
    """Drafting costs 0.3 ms a proposal, and the first after plain steps reads every token decoded since (a draft
    model's forward over them): 3 ms more."""

    def propose(self, context, k: int) -> Proposal:
        if k:
            time.sleep(0.0003 if self.asked and self.asked[-1] else 0.0033)
        return super().propose(context, k)


def test_a_probes_price_includes_catching_up_as_measured() -> None:
    """Per-step prices leave catching up out (it is not a cost per drafted token), so the last probe's measured cost
    spaces the next: 3 ms more over a 1 ms step keeps probes PROBE_WAIT_MAX steps apart, where the predicted price
    alone (0.3 of a step) would probe every 30 to 64 steps."""
    inner = CatchingUp()
    session = AdaptiveK(inner).begin(None)
    for _ in range(2 * PROBE_WAIT_MAX + 40):
        session.propose([1, 2, 3], 8)
        time.sleep(0.001)  # the target's forward
        session.accepted(Verdict([]))
    # The plain runs between drafting steps (a probe that looked good may draft a step more: timing decides that).
    drafted = [i for i, k in enumerate(inner.asked) if k]
    gaps = [b - a - 1 for a, b in zip(drafted, drafted[1:]) if b - a > 1]
    assert gaps and gaps[-1] == PROBE_WAIT_MAX


def test_a_stalled_timing_never_prices_n_tokens_above_n_forwards() -> None:
    t = Timings()
    for _ in range(3):
        t.observe(0, 0.0, 1, 0.010)
    t.observe(1, 0.001, 2, 0.011)  # the first two-token forward, left out
    t.observe(1, 0.001, 2, 0.200)  # a stall, the only two-token timing
    assert t.costs()[1](2) == 2.0


def test_probes_come_at_least_every_probe_wait_max_steps() -> None:
    inner = Never()
    session = AdaptiveK(inner, costs=(0.5, lambda n: float(n))).begin(None)  # a probe looks very costly
    for _ in range(3 * PROBE_WAIT_MAX):
        session.propose([1, 2, 3], 8)
        session.accepted(Verdict([]))
    probes = [i for i, k in enumerate(inner.asked) if k]
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert len(probes) == 2 and max(gaps) <= PROBE_WAIT_MAX + 1
