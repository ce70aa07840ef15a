"""Lookahead decoding (Fu et al. 2024): Jacobi iteration guesses n-grams, and the target verifies them.

No draft model. Every target forward carries, besides the verification tree, a 2-D window of guessed
tokens (N - 1 levels x W columns) as a side branch; the target's argmax at the newest level is one Jacobi
step further along each column. Each column's trajectory then reads as an n-gram, which goes into a pool
keyed by its first token. The pool's n-grams that start with the last committed token are the next
proposal, a trie verified in the same forward as the window. The window only guesses; verification
keeps the output exact (greedy) or distributed as the target's (sampling: the guesses are one-hot q).
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from verispec.argument_checks import whole_number
from verispec.drafters.base import DraftContext, Needs, Proposal, SideBranch, Verdict
from verispec.drafters.options import LookaheadOptions
from verispec.models.greedy import argmax
from verispec.models.protocol import CausalLM


class NgramPool:
    """N-grams keyed by their first token: per key at most `cap` continuations, distinct, the latest kept."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, continuation: Sequence[int]) -> None:
        grams = self.grams.setdefault(key, [])
        continuation = tuple(continuation)
        if continuation in grams:  # seen again: it becomes the latest
            grams.remove(continuation)
        grams.append(continuation)
        if len(grams) > self.cap:
            del grams[0]

    def add_text(self, tokens: Sequence[int], n: int) -> None:
        """Every n-gram of `tokens`, in order (so the last ones are the latest)."""
        for i in range(len(tokens) - n + 1):
            self.add(tokens[i], tokens[i + 1 : i + n])

    def get(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of `key`, latest first."""
        return self.grams.get(key, [])[::-1]


def window_layout(levels: int, columns: int) -> tuple[torch.Tensor, list[int]]:
    """Mask (S, S) and offsets from the last committed token of a window of levels x columns tokens, level by level.

    Token (l, j) sits at offset l + j + 1 and sees level 0 up to column j and its own column up to level l:
    the trajectory that Jacobi iteration has produced for it, at consecutive positions.
    """
    level = torch.arange(levels).repeat_interleave(columns)  # (S,)
    column = torch.arange(columns).repeat(levels)
    first_level = (level[None, :] == 0) & (column[None, :] <= column[:, None])
    own_column = (column[None, :] == column[:, None]) & (level[None, :] <= level[:, None])
    return first_level | own_column, (level + column + 1).tolist()


def candidate_tree(grams: Sequence[Sequence[int]], k: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie of the n-grams cut to k tokens: shared prefixes are verified once."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for gram in grams:
        parent = -1
        for token in gram[:k]:
            node = node_of.get((parent, token))
            if node is None:
                node = node_of[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return tokens, parents


class Lookahead:
    """Lookahead decoding with a window of W columns, n-grams of N tokens and up to G candidates per step.

    The window starts as one level of random prompt tokens (the reference implementation's default; seeded, so
    runs repeat) and gains a level per step until it has N - 1; after that each step drops the oldest level.
    As in the reference implementation, the window moves one position per step whatever was accepted (unlike
    it, the window keeps W columns while it fills instead of starting wider and narrowing). With `text_ngrams`
    (the reference's POOL_FROM_PROMPT) the pool also takes every n-gram of the prompt and of the committed text.
    """

    name = "lookahead"
    batched = False  # its window rides in the target's forward, through a per-sequence tree mask
    needs = Needs(tree_masks=True)  # the window and the candidate trie share one forward through a custom mask

    def __init__(
        self,
        window: int = LookaheadOptions.window,
        ngram: int = LookaheadOptions.ngram,
        candidates: int = LookaheadOptions.candidates,
        *,
        text_ngrams: bool = True,
        seed: int = 0,
    ) -> None:
        window = whole_number(window, "lookahead window", 1)
        ngram = whole_number(ngram, "lookahead ngram", 2)
        candidates = whole_number(candidates, "lookahead candidates", 1)
        self.window, self.ngram, self.candidates, self.seed = window, ngram, candidates, seed
        self.text_ngrams = text_ngrams
        self.k = ngram - 1
        self.width = (candidates + window) * (ngram - 1)

    def check(self, target: CausalLM) -> None:
        """Any target that takes tree masks."""

    def begin(self, context: DraftContext) -> LookaheadSession:
        return LookaheadSession(self, context.prompt)


class LookaheadSession:
    """The Jacobi window (a list of levels, oldest first) and the n-gram pool of one generation."""

    def __init__(self, drafter: Lookahead, prompt: Sequence[int]) -> None:
        self.window, self.ngram, self.text_ngrams = drafter.window, drafter.ngram, drafter.text_ngrams
        rng = random.Random(drafter.seed)
        self.levels = [[rng.choice(prompt) for _ in range(self.window)]]
        self.pool = NgramPool(drafter.candidates)
        self._seen = 0  # committed tokens whose n-grams are in the pool
        self._add_text(prompt)

    def _add_text(self, context: Sequence[int]) -> None:
        """The n-grams that end in tokens committed since the last call."""
        if self.text_ngrams:
            self.pool.add_text(context[max(0, self._seen - self.ngram + 1) :], self.ngram)
        self._seen = len(context)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self._add_text(context)
        if k < 1:  # asked for nothing (adaptive k switched drafting off): no window either
            return Proposal([])
        tokens, parents = candidate_tree(self.pool.get(context[-1]), k)
        mask, offsets = window_layout(len(self.levels), self.window)
        side = SideBranch([t for level in self.levels for t in level], offsets, mask)
        return Proposal(tokens, None, parents, side)

    def accepted(self, verdict: Verdict) -> None:
        """One Jacobi step: the argmax at the newest level becomes a new level; full columns become n-grams."""
        if verdict.side_logits is None:  # abandoned before the target saw the window: nothing learned
            return
        newest = argmax(verdict.side_logits[-self.window :]).tolist()
        if len(self.levels) == self.ngram - 1:
            for j, token in enumerate(newest):
                self.pool.add(self.levels[0][j], [level[j] for level in self.levels[1:]] + [token])
            self.levels = self.levels[1:]
        self.levels.append(newest)
