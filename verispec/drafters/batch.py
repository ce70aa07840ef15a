"""Drafting for a batch: one session drafts for every sequence of the batched engine, each in its own slot.

A drafter that declares `batched = True` offers `begin_batch(target, slots)`; the engine adds a sequence to a slot
when it joins, asks for proposals of all the sequences that draft in a step at once, tells the verdicts, and
removes the sequence when it leaves. Proposals are chains (no trees, no side branches): the engine verifies every
sequence's chain in one target forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

import torch

from verispec.drafters.base import Proposal, Verdict
from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.constraint import Constraint


@dataclass(frozen=True)
class SequenceStart:
    """What a sequence's drafting starts from: its prompt, its sampling settings, its own generator and its grammar
    (as `DraftContext.grammar`)."""

    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    grammar: Constraint | None = None


class BatchDraftSession(Protocol):
    """Drafting state for the sequences in the engine's slots."""

    def add(self, slot: int, start: SequenceStart) -> None:
        """A sequence joins in `slot` (the target has been prefilled with its prompt but the last token)."""

    def propose(self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int]) -> dict[int, Proposal]:
        """A chain for each slot in `ks`, at most ks[slot] >= 1 deep, to follow contexts[slot] (every token that
        sequence has committed); drawn with each sequence's own sampling settings and generator."""

    def accepted(self, verdicts: Mapping[int, Verdict]) -> None:
        """The target's verdicts on the last proposals; roll back each slot's state past its accepted tokens."""

    def rollback(self, slot: int, committed: int) -> None:
        """The step failed before its verdicts: forget anything past the sequence's `committed` tokens."""

    def remove(self, slot: int) -> None:
        """The sequence in `slot` left; the slot may be reused."""
