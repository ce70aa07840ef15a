"""Lookahead decoding: the window's mask and offsets, the n-gram pool, the Jacobi update, and exactness end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from drafting import start_session
from verispec import InvalidArgumentError, Lookahead, TransformersModel, Verdict, generate, load
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main
from verispec.drafters.lookahead import NgramPool, candidate_tree, window_layout
from verispec.errors import IncompatibleTargetError
from verispec.models.native import NativeModel, load_model

# The tiny random target decodes this prompt greedily into short loops (e.g. 25 12 71 25 12 71 ...), the kind of
# repetition that lookahead's n-grams catch.
PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]
REPEATED = [5, 6, 7, 8] * 6


pytestmark = pytest.mark.usefixtures("single_thread")


def test_window_layout_hand_checked() -> None:
    # 3 levels x 2 columns, level by level: (0,0) (0,1) (1,0) (1,1) (2,0) (2,1)
    mask, offsets = window_layout(3, 2)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # (0,0): itself
            [1, 1, 0, 0, 0, 0],  # (0,1): level 0 up to column 1
            [1, 0, 1, 0, 0, 0],  # (1,0): (0,0), then its column
            [1, 1, 0, 1, 0, 0],  # (1,1): (0,0) (0,1), then (1,1)
            [1, 0, 1, 0, 1, 0],  # (2,0): its column
            [1, 1, 0, 1, 0, 1],  # (2,1): (0,0) (0,1) (1,1) (2,1)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert offsets == [1, 2, 2, 3, 3, 4]  # each sees consecutive positions 1 .. its own


def test_pool_keys_caps_and_deduplicates() -> None:
    pool = NgramPool(cap=2)
    pool.add(1, [2, 3])
    pool.add(1, [4, 5])
    pool.add(1, (2, 3))  # again: no duplicate, it becomes the latest
    assert pool.get(1) == [(2, 3), (4, 5)]
    pool.add(1, [6, 7])  # over the cap: the oldest, (4, 5), goes
    assert pool.get(1) == [(6, 7), (2, 3)]
    pool.add(9, [1, 1])
    assert pool.get(1) == [(6, 7), (2, 3)] and pool.get(9) == [(1, 1)] and pool.get(4) == []
    text = NgramPool(cap=5)
    text.add_text([1, 2, 3, 1, 2, 4], 3)
    assert text.get(1) == [(2, 4), (2, 3)] and text.get(2) == [(3, 1)] and text.get(3) == [(1, 2)]


def test_candidate_tree_shares_prefixes_and_cuts_to_k() -> None:
    tokens, parents = candidate_tree([(5, 6, 7), (5, 8, 9), (3, 4, 1)], k=2)
    assert (tokens, parents) == ([5, 6, 8, 3, 4], [-1, 0, 0, -1, 3])


def test_propose_sends_pool_candidates_and_the_window(target: NativeModel) -> None:
    drafter = start_session(Lookahead(window=2, ngram=3, candidates=2, text_ngrams=False), target, PROMPT)
    assert len(drafter.levels) == 1 and all(t in PROMPT for t in drafter.levels[0])  # random prompt tokens
    drafter.levels = [[10, 11], [20, 21]]
    drafter.pool.add(32, [7, 8])
    drafter.pool.add(32, [7, 9])
    drafter.pool.add(33, [1, 2])
    proposal = drafter.propose(PROMPT, k=2)
    assert proposal.q is None  # one-hot q
    assert (proposal.tokens, proposal.parents) == ([7, 9, 8], [-1, 0, 0])  # the latest n-gram first
    assert proposal.side.tokens == [10, 11, 20, 21] and proposal.side.offsets == [1, 2, 2, 3]
    assert torch.equal(proposal.side.mask, window_layout(2, 2)[0])
    assert drafter.propose(PROMPT + [5], k=1).tokens == []  # nothing keyed by 5


def test_jacobi_step_reads_the_newest_level(target: NativeModel) -> None:
    drafter = start_session(Lookahead(window=3, ngram=3, candidates=5, text_ngrams=False), target, PROMPT)
    drafter.levels = [[10, 11, 12], [20, 21, 22]]  # full: N - 1 levels
    side_logits = torch.zeros(6, target.vocab_size)
    side_logits[torch.arange(6), torch.arange(100, 106)] = 1.0  # side row i predicts 100 + i
    drafter.accepted(Verdict([0], side_logits))
    assert drafter.levels == [[20, 21, 22], [103, 104, 105]]  # rows 3..5 are the newest level
    assert [drafter.pool.get(key) for key in (10, 11, 12)] == [[(20, 103)], [(21, 104)], [(22, 105)]]


def test_window_fills_one_level_per_step_before_collecting(target: NativeModel) -> None:
    drafter = start_session(Lookahead(window=2, ngram=4, candidates=5, text_ngrams=False), target, PROMPT)
    for level in range(1, 3):
        side_logits = torch.zeros(2 * level, target.vocab_size)
        side_logits[-2:, 50 + level] = 1.0
        drafter.accepted(Verdict([], side_logits))
        assert len(drafter.levels) == level + 1 and drafter.levels[-1] == [50 + level] * 2
    assert drafter.pool.grams == {}  # no full trajectory yet


@pytest.mark.parametrize("prompt", [PROMPT, REPEATED], ids=["plain", "repeated"])
@pytest.mark.parametrize("window,ngram,candidates", [(5, 4, 5), (3, 2, 2), (1, 5, 1), (8, 3, 3)])
def test_greedy_is_identical_to_autoregressive(target: NativeModel, prompt, window, ngram, candidates) -> None:
    truth = generate(target, prompt, max_new_tokens=40, ignore_eos=True).tokens
    result = generate(target, prompt, Lookahead(window, ngram, candidates), max_new_tokens=40, ignore_eos=True)
    assert result.tokens == truth
    assert result.stats.new_tokens == 40


def test_window_fits_at_the_end_of_the_context(target: NativeModel) -> None:
    """The window (width (G + W)(N - 1)) rides along until the sequence fills the context."""
    prompt = (PROMPT * 30)[: target.context_length - 12]
    truth = generate(target, prompt, max_new_tokens=40, ignore_eos=True)
    result = generate(target, prompt, Lookahead(5, 4, 5), max_new_tokens=40, ignore_eos=True)
    assert result.tokens == truth.tokens and result.stop_reason == truth.stop_reason == "context_length"


def test_the_jacobi_window_alone_finds_the_loops(target: NativeModel) -> None:
    """With the pool fed by the window only, a looping continuation is still drafted well: measured 26 of 60 tokens
    accepted (W=5, N=4, G=5); reading the wrong side rows gave 0-8, random side logits 0."""
    truth = generate(target, PROMPT, max_new_tokens=60, ignore_eos=True).tokens
    window_only = generate(target, PROMPT, Lookahead(5, 4, 5, text_ngrams=False), max_new_tokens=60, ignore_eos=True)
    assert window_only.tokens == truth
    assert window_only.stats.accepted >= 15, window_only.stats.accepted
    both = generate(target, PROMPT, Lookahead(5, 4, 5), max_new_tokens=60, ignore_eos=True)
    assert both.tokens == truth and both.stats.accepted >= 15 and both.stats.target_calls < 45


def test_sampling_is_reproducible_with_a_seed(target: NativeModel) -> None:
    runs = [
        generate(target, REPEATED, Lookahead(), max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 30


# ---------------------------------------------------------------------------------------------------------------
# Sampling keeps the target distribution: two tokens from a vocabulary of 6, against exact probabilities.

VOCAB = 6
SAMPLING_PROMPT = [2, 3, 1, 2, 5, 4, 2]  # 2 was followed by 3, then 5: with N=2, G=2 the first step verifies 5, 3
DRAWS = 3000
P_VALUE_MIN = 1e-3


def test_sampling_follows_the_target_distribution(tmp_path: Path, reference_probs) -> None:
    """Pairs of new tokens are distributed as under the target, and the first token comes from the two one-hot
    candidates with probability p(5) + p(3), the optimum of the multi-candidate rule."""
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    folder = random_checkpoint(tmp_path / "target", config, seed=3)  # p(5) = 0.42, p(3) = 0.15
    contexts = np.array([SAMPLING_PROMPT + [x] for x in range(VOCAB)])
    probs = reference_probs(folder, contexts)  # temperature 1
    first = probs[0, -2]
    joint = first[:, None] * probs[:, -1]
    accept = first[5] + first[3]
    assert 0.2 < accept < 0.8  # non-degenerate: candidates both kept and rejected
    target, counts, drafted = load_model(folder), np.zeros((VOCAB, VOCAB)), 0
    for seed in range(DRAWS):
        out = generate(
            target,
            SAMPLING_PROMPT,
            Lookahead(window=2, ngram=2, candidates=2),
            max_new_tokens=2,
            temperature=1.0,
            seed=seed,
            ignore_eos=True,
        )
        counts[out.tokens[0], out.tokens[1]] += 1
        drafted += out.drafted[0]
    expected = joint.ravel() * DRAWS
    assert expected.min() >= 5  # enough for the chi-square test in every cell (here at least 10.8)
    pvalue = stats.chisquare(counts.ravel(), expected).pvalue
    tv = 0.5 * np.abs(counts.ravel() / DRAWS - joint.ravel()).sum()
    assert pvalue > P_VALUE_MIN and tv < (VOCAB * VOCAB / DRAWS) ** 0.5, (pvalue, tv)
    sigma = (accept * (1 - accept) / DRAWS) ** 0.5
    assert abs(drafted / DRAWS - accept) < 5 * sigma, (drafted / DRAWS, accept)


# ---------------------------------------------------------------------------------------------------------------
# Bad input, and the command line


@pytest.mark.parametrize("options", [dict(window=0), dict(ngram=1), dict(candidates=0), dict(window=2.5)])
def test_bad_options_are_refused(options) -> None:
    with pytest.raises(InvalidArgumentError, match="lookahead"):
        Lookahead(**options)


def test_cli_lookahead_matches_autoregressive(capsys, pair_dirs) -> None:
    code = main(
        [
            "generate",
            "def f(x):",
            "--target",
            str(pair_dirs[0]),
            "--method",
            "lookahead",
            "--window",
            "3",
            "--ngram-size",
            "3",
            "--candidates",
            "2",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--compare",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and "identical to autoregressive: yes" in out


def test_a_transformers_target_is_refused(pair_dirs) -> None:
    """Only the native runtime takes the custom attention mask that the window needs."""
    target = load(pair_dirs[0], backend="transformers")
    assert isinstance(target, TransformersModel)
    with pytest.raises(IncompatibleTargetError, match="native runtime"):
        generate(target, PROMPT, Lookahead(), max_new_tokens=4)


@pytest.mark.parametrize("options, message", [(["--window", "0"], "lookahead window"), (["-k", "3"], "--ngram-size")])
def test_cli_refuses_bad_options(capsys, pair_dirs, options, message) -> None:
    code = main(["generate", "x", "--target", str(pair_dirs[0]), "--method", "lookahead", *options])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("verispec: error: ") and message in err and err.count("\n") == 1
