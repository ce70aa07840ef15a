"""Adaptive k for a drafter that scores its own tokens (suffix decoding): the cut against the step model's formula,
the calibration of the drafter's estimates by the verdicts, prefixes of chains and trees, and the loop (greedy
identity, the cut following the verdicts, sampling's distribution kept)."""

from __future__ import annotations

import numpy as np
import pytest

from drafting import OwnSession, last_two_of_four
from test_verify import P_VALUE_MIN, compare
from verispec import generate
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cost_model import CALIBRATION_WEIGHT, Calibration, best_prefix
from verispec.drafters.adaptive import AdaptiveK
from verispec.drafters.base import Proposal, Verdict
from verispec.drafters.registry import Method, build_drafter
from verispec.drafters.suffix import SuffixDecoding
from verispec.models.native import load_default, load_model
from verispec.tree import cut_after_eos, subset

pytestmark = pytest.mark.usefixtures("single_thread")


def brute_force(chances, r, overhead: float) -> int:
    speeds = [1 / (1 + overhead)] + [(1 + sum(chances[:n])) / (r(n + 1) + overhead) for n in range(1, len(chances) + 1)]
    return int(np.argmax(speeds))  # the first (shortest) on a tie


@pytest.mark.parametrize(
    "chances, slope, overhead",
    [
        ([0.9, 0.9, 0.1], 0.1, 0.0),
        ([0.9] * 8, 0.05, 0.0),
        ([0.05] * 4, 0.1, 0.0),
        ([0.3, 0.2, 0.1], 0.15, 0.2),
        ([1.0] * 6, 0.0, 0.0),
        ([0.0] * 3, 0.0, 0.0),
        ([0.6, 0.6, 0.5, 0.1, 0.1], 0.25, 0.1),
    ],
)
def test_best_prefix_maximises_the_formula(chances, slope, overhead) -> None:
    r = lambda n: 1 + slope * (n - 1)
    assert best_prefix(chances, r, overhead) == brute_force(chances, r, overhead)


def test_best_prefix_by_hand() -> None:
    r = lambda n: 1.0 + 0.1 * (n - 1)
    # n=1: 1.9 / 1.1 = 1.73; n=2: 2.8 / 1.2 = 2.33; n=3: 2.9 / 1.3 = 2.23
    assert best_prefix([0.9, 0.9, 0.1], r) == 2
    assert best_prefix([0.05, 0.9], r) == 2  # a likely token behind an unlikely one: both, or nothing
    assert best_prefix([0.05], r) == 0 and best_prefix([], r) == 0  # 1.05 / 1.1 < 1: a plain step


def test_calibration_learns_what_an_estimate_is_worth() -> None:
    cal = Calibration(decay=1.0)
    assert cal.chance(1.0) == 1.0 and cal.chance(0.35) == 0.35  # before any verdict: the estimate itself
    for accepted in [True, False, False, False, False, False]:
        cal.observe(1.0, accepted)
    assert cal.chance(1.0) == pytest.approx((1 + CALIBRATION_WEIGHT) / (6 + CALIBRATION_WEIGHT))
    assert cal.chance(0.35) == 0.35  # another bin: untouched
    for _ in range(200):
        cal.observe(0.5, True)
    assert cal.chance(0.55) > 0.98


def test_prefixes_and_subsets_keep_the_estimates() -> None:
    tree = Proposal([5, 6, 7, 8], parents=[-1, 0, -1, 1], confidence=[0.8, 0.6, 0.2, 0.1])
    cut = subset(tree, [0, 1])  # a prefix, as adaptive k cuts
    assert cut.tokens == [5, 6] and cut.parents == [-1, 0] and cut.confidence == [0.8, 0.6]
    assert subset(tree, [0, 1, 2, 3]) is tree and subset(tree, []).tokens == [] and subset(tree, []).confidence == []
    kept, index = cut_after_eos(tree, frozenset({6}))  # 8 follows the end of sequence: dropped
    assert kept.tokens == [5, 6, 7] and kept.confidence == [0.8, 0.6, 0.2] and index == [0, 1, 2]


class Scored(OwnSession):
    """A chain last + 1, last + 2, ... with fixed estimates."""

    name, scores = "scored", True

    def __init__(self, estimates: list[float]) -> None:
        self.estimates = estimates
        self.k = self.width = len(estimates)

    def propose(self, context, k: int) -> Proposal:
        n = min(k, len(self.estimates))
        return Proposal([(context[-1] + 1 + i) % VOCAB for i in range(n)], confidence=self.estimates[:n])

    def accepted(self, verdict) -> None:
        pass


def test_a_scored_proposal_is_cut_where_it_stops_paying_and_learns_from_verdicts() -> None:
    r = lambda n: 1.0 + 0.1 * (n - 1)
    session = AdaptiveK(Scored([0.9, 0.9, 0.05, 0.05]), costs=(0.0, r)).begin(None)
    proposal = session.propose([1, 2], 4)
    assert proposal.tokens == [3, 4] and proposal.confidence == [0.9, 0.9]  # asked the most, cut to 2
    cuts = []
    for _ in range(60):  # nothing is ever accepted: the 0.9 estimates are worth less and less
        session.accepted(Verdict([]))
        cuts.append(len(session.propose([1, 2], 4).tokens))
    assert cuts[0] == 2 and cuts[-20:].count(0) >= 18 and 1 in cuts[-20:]  # plain steps, and one-token probes
    assert cuts[: cuts.index(0)] == sorted(cuts[: cuts.index(0)], reverse=True)
    for _ in range(60):  # then every token is accepted: the probes bring the estimates, and the cut, back
        session.accepted(Verdict(list(range(cuts[-1]))))
        cuts.append(len(session.propose([1, 2], 4).tokens))
    assert cuts[-1] == 2
    plain = AdaptiveK(Scored([0.05, 0.05]), costs=(0.0, r)).begin(None)
    assert plain.propose([1, 2], 2).tokens == []  # a plain step


def test_suffix_declares_its_scores_and_auto_cuts_it() -> None:
    assert SuffixDecoding().scores
    drafter = build_drafter(Method("suffix", "auto", {"tree_tokens": 8}))
    assert isinstance(drafter, AdaptiveK) and drafter.scores and not drafter.chain


@pytest.fixture(scope="module")
def shipped():
    return load_default()[0]


@pytest.mark.parametrize("method", [Method("suffix", "auto"), Method("suffix", "auto", {"tree_tokens": 8})])
def test_greedy_identity_with_the_cut(shipped, method) -> None:
    prompt = "def area(width, height):\n    return width * height\n\n\ndef volume(width, height, depth):\n"
    truth = generate(shipped, prompt, max_new_tokens=48, ignore_eos=True)
    runs = [generate(shipped, prompt, build_drafter(method), max_new_tokens=48, ignore_eos=True) for _ in range(2)]
    assert all(run.tokens == truth.tokens for run in runs)
    assert runs[0].stats.accepted > 0


# ---------------------------------------------------------------------------------------------------------------
# sampling: the cut is made from the committed text and past verdicts only, so the distribution is the target's

VOCAB, PROMPT, DRAWS, NEW = 6, [1, 4, 2], 3000, 4  # four new tokens, as last_two_of_four takes them


def test_sampling_with_the_cut_follows_the_target(tmp_path, reference_probs) -> None:
    """Four tokens sampled with the cut moving between 0, 1 and 2 tokens with the verdicts (the estimates are
    calibrated by them): the last two tokens are distributed as under the target."""
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    folder = random_checkpoint(tmp_path / "target", config, seed=1)
    target = load_model(folder)
    last_two = last_two_of_four(folder, PROMPT, VOCAB, reference_probs)
    drafter = AdaptiveK(Scored([0.45, 0.4]), costs=(0.0, lambda n: 1.0 + 0.3 * (n - 1)))
    counts, depths = np.zeros((VOCAB, VOCAB)), set()
    for seed in range(DRAWS):
        out = generate(target, PROMPT, drafter, max_new_tokens=NEW, temperature=1.0, seed=seed, ignore_eos=True)
        counts[out.tokens[2], out.tokens[3]] += 1
        depths.add(tuple(out.stats.steps_by_depth))
    assert len(depths) > 2  # the cut did vary with the verdicts
    pvalue, tv = compare(counts.ravel(), last_two.ravel())
    assert pvalue > P_VALUE_MIN and tv < (last_two.size / DRAWS) ** 0.5, (pvalue, tv)


def test_method_suffix_alone_is_the_cut_chain_and_a_tree_stays_fixed() -> None:
    from verispec.cli import loading
    from verispec.cli.parser import build_parser
    from verispec.drafters.registry import resolve_method

    parse = lambda *extra: resolve_method(
        loading.method_from(build_parser().parse_args(["generate", "x", "--method", "suffix", *extra]))
    )
    assert parse().k == "auto" and parse("-k", "8").k == 8
    assert parse("--tree-tokens", "8").k == 8 and parse("--tree-tokens", "8", "-k", "auto").k == "auto"
