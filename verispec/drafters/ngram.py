"""Prompt lookup: propose what followed the latest earlier occurrence of the text's last n tokens.

Costs no model call, and pays off where the output repeats the prompt (code edits, quoting, tables).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from verispec.argument_checks import whole_number
from verispec.drafters.base import DraftContext, Needs, Proposal, Verdict
from verispec.drafters.batch import SequenceStart
from verispec.drafters.options import FIXED_K, NgramOptions
from verispec.errors import InvalidArgumentError
from verispec.models.protocol import CausalLM


class PromptLookup:
    """Proposes up to k tokens that followed the longest n-gram (min_ngram <= n <= max_ngram) ending the text."""

    name = "ngram"
    needs = Needs()  # nothing of the target: it reads only the committed tokens
    batched = True

    def __init__(
        self, k: int = FIXED_K, max_ngram: int = NgramOptions.max_ngram, min_ngram: int = NgramOptions.min_ngram
    ) -> None:
        k = whole_number(k, "k (tokens drafted per step)", 1)
        max_ngram, min_ngram = whole_number(max_ngram, "max_ngram", 1), whole_number(min_ngram, "min_ngram", 1)
        if min_ngram > max_ngram:
            raise InvalidArgumentError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.k = self.width = k
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def check(self, target: CausalLM) -> None:
        """Any target will do."""

    def begin(self, context: DraftContext) -> NgramIndex:
        return NgramIndex(self.max_ngram, self.min_ngram, context.prompt)

    def begin_batch(self, target: CausalLM, slots: int) -> NgramBatch:
        """Prompt lookup for the batched engine: an index per sequence."""
        return NgramBatch(self)


class NgramIndex:
    """An index from each n-gram to where its latest continuation starts.

    The index grows with the committed tokens only (never a rescan); proposals carry no probabilities,
    so the sampling rule treats them as one-hot q.
    """

    def __init__(self, max_ngram: int, min_ngram: int, prompt: Sequence[int]) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        self._extend(prompt)

    def _extend(self, new: Sequence[int]) -> None:
        for token in new:
            # The n-grams ending just before this token now have a continuation: this token's position.
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self._extend(context[len(self.tokens) :])
        for n in range(min(self.max_ngram, len(self.tokens)), self.min_ngram - 1, -1):
            start = self.index.get(tuple(self.tokens[-n:]))
            if start is not None:
                return Proposal(self.tokens[start : start + k])
        return Proposal([])

    def accepted(self, verdict: Verdict) -> None:
        """Nothing to roll back: proposals enter the index only once the target has committed them."""


class NgramBatch:
    """Prompt lookup for a batch: an `NgramIndex` per slot. It runs no model, so there is no forward to batch."""

    def __init__(self, drafter: PromptLookup) -> None:
        self.drafter, self.indexes = drafter, {}

    def add(self, slot: int, start: SequenceStart) -> None:
        self.indexes[slot] = NgramIndex(self.drafter.max_ngram, self.drafter.min_ngram, start.prompt)

    def propose(self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int]) -> dict[int, Proposal]:
        return {slot: self.indexes[slot].propose(contexts[slot], k) for slot, k in ks.items()}

    def accepted(self, verdicts: Mapping[int, Verdict]) -> None:
        """Nothing to roll back (see `NgramIndex.accepted`)."""

    def rollback(self, slot: int, committed: int) -> None:
        """Nothing to roll back: the index holds committed tokens only."""

    def remove(self, slot: int) -> None:
        del self.indexes[slot]
