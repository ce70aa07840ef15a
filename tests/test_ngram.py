"""Prompt lookup: its incremental n-gram index, and exactness through the loop."""

from __future__ import annotations

import pytest

from verispec import InvalidArgumentError, PromptLookup, SamplingParams, generate
from verispec.cli import main
from verispec.drafters.base import DraftContext
from verispec.drafters.ngram import NgramIndex


def started(prompt: list[int], **options) -> NgramIndex:
    return PromptLookup(**options).begin(DraftContext(None, prompt, SamplingParams(), None, None))


def test_longest_ngram_wins_and_latest_occurrence_is_used() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    prompt = [1, 2, 3, 9, 5, 2, 3, 4, 7, 2]
    drafter = started(prompt, k=3, max_ngram=2)
    assert drafter.propose(prompt, 3).tokens == [3, 4, 7]  # "2" last continued at position 6
    context = prompt + [3]  # now "2 3": continued at 3 and at 7; the latest wins
    assert drafter.propose(context, 3).tokens == [4, 7, 2]
    assert started([1, 2, 3, 1, 2], k=3, max_ngram=2).propose([1, 2, 3, 1, 2], 3).tokens == [3, 1, 2]


def test_no_match_proposes_nothing_and_short_tails_are_fine() -> None:
    assert started([1, 2, 3]).propose([1, 2, 3], 4).tokens == []
    assert started([5, 6, 5]).propose([5, 6, 5], 4).tokens == [6, 5]  # the continuation runs into the end
    assert started([4], min_ngram=1).propose([4], 4).tokens == []


def test_min_ngram_ignores_shorter_matches() -> None:
    prompt = [1, 2, 3, 4, 2]
    assert started(prompt, max_ngram=3, min_ngram=2).propose(prompt, 2).tokens == []
    assert started(prompt, max_ngram=3, min_ngram=1).propose(prompt, 2).tokens == [3, 4]


def test_index_grows_with_committed_tokens_only() -> None:
    drafter = started([1, 2, 3])
    size = len(drafter.index)
    assert drafter.propose([1, 2, 3, 1], 2).tokens == [2, 3]
    assert drafter.tokens == [1, 2, 3, 1] and len(drafter.index) > size  # the proposal [2, 3] is not in it
    assert drafter.propose([1, 2, 3, 1, 5], 2).tokens == []  # "5" was never committed before


@pytest.mark.parametrize("options", [dict(k=0), dict(min_ngram=0), dict(min_ngram=3, max_ngram=2)])
def test_bad_options(options) -> None:
    with pytest.raises(InvalidArgumentError):
        PromptLookup(**options)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identity_on_repetitive_text(target, k) -> None:
    prompt = target.tokenizer.encode("for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n").ids
    plain = generate(target, prompt, max_new_tokens=40, ignore_eos=True)
    looked_up = generate(target, prompt, PromptLookup(k), max_new_tokens=40, ignore_eos=True)
    assert looked_up.tokens == plain.tokens
    assert looked_up.stats.accepted > 0  # the random target repeats itself, so lookup finds its continuations


def test_sampling_with_lookup_is_reproducible(target) -> None:
    runs = [generate(target, "abcabcabc", PromptLookup(4), max_new_tokens=20, temperature=1.0, seed=5) for _ in "ab"]
    assert runs[0].tokens == runs[1].tokens


def test_cli_method_ngram(capsys, pair_dirs) -> None:
    code = main(
        [
            "generate",
            "abcabc",
            "--target",
            str(pair_dirs[0]),
            "--method",
            "ngram",
            "--max-ngram",
            "2",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--compare",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "identical to autoregressive: yes" in out and "drafted" in out
