"""The Drafter protocol: every method of proposing tokens plugs into the generation loop through it.

A `Drafter` is a recipe: its settings and any weights it reads, never the state of one generation. `begin` starts
a `DraftSession` that holds that state, so one drafter can serve several generations at once, from several
threads. To write a drafter, read this file and `ngram.py` (the smallest example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from verispec.constraint import Constraint
from verispec.errors import IncompatibleTargetError
from verispec.models.protocol import CausalLM, SequenceCache
from verispec.proposal import Proposal, SideBranch, Verdict
from verispec.sampling import SamplingParams

__all__ = ["SideBranch", "Proposal", "Verdict", "Needs", "DraftContext", "DraftSession", "Drafter", "check_target"]


@dataclass(frozen=True)
class Needs:
    """What a drafter needs of the target's forward; the loop refuses a target that lacks it, before any work."""

    tree_masks: bool = False  # it proposes token trees or side branches
    hidden_states: tuple[int, ...] = ()  # the target layers it reads (block indices, or models.protocol.FINAL)
    layer_subsets: bool = False  # it runs the target with some blocks left out
    twin: bool = False  # it drafts with a quantized twin of the target's weights (models/twin.py)


@dataclass(frozen=True)
class DraftContext:
    """What a session starts from: the target, the prompt, and the target's state after the prefill."""

    target: CausalLM
    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    # The target's cache: at each `propose` it holds every committed token but the last. A drafter that runs the
    # target itself (layer skip) may write past that and must truncate back before returning.
    cache: SequenceCache
    # (len(prompt) - 1, len(layers), D): the target's hidden states at the prefilled prompt tokens (all but the
    # last), when `needs.hidden_states` names layers; None otherwise.
    hidden: torch.Tensor | None = None
    # The grammar the output must follow, if any: a drafter that samples draws from q masked by it
    # (`grammar.constrain(logits, tokens drafted so far)`), or the loop refuses its proposal; the loop drops the tokens
    # it forbids from any proposal before verification, so a drafter that does not sample may ignore it.
    grammar: Constraint | None = None


class DraftSession(Protocol):
    """One generation's drafting state."""

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        """Tokens to follow `context` (every token committed so far), at most k deep. k may be 0 (adaptive k
        switched drafting off for this step): then nothing at all, no side branch either; the verdict follows."""

    def accepted(self, verdict: Verdict) -> None:
        """The target's verdict on the last proposal; roll back any state past the accepted tokens."""


class Drafter(Protocol):
    name: str
    k: int  # the deepest proposal: at most this many tokens can be accepted per step
    width: int  # the most tokens one proposal puts into the target's forward (tree nodes and side branch)
    needs: Needs
    # `begin_batch(target, slots) -> drafters.batch.BatchDraftSession` drafts for the batched engine
    # (`verispec.engine`); a drafter that does not declare it cannot draft there
    batched: bool

    def check(self, target: CausalLM) -> None:
        """Refuse, with a VerispecError, a target this drafter cannot draft for (beyond `needs`); cheap, no work."""

    def begin(self, context: DraftContext) -> DraftSession:
        """A new session for one generation."""


def check_target(drafter: Drafter, target: CausalLM) -> None:
    """Refuse a target that lacks what the drafter declares it needs, then run the drafter's own checks."""
    needs, can = drafter.needs, target.capabilities
    missing = [
        what
        for what, needed, has in (
            ("tree attention masks", needs.tree_masks, can.tree_masks),
            ("hidden states", bool(needs.hidden_states), can.hidden_states),
            ("running a subset of its layers", needs.layer_subsets, can.layer_subsets),
            ("a twin made of its weights", needs.twin, can.twins),
        )
        if needed and not has
    ]
    if missing:
        raise IncompatibleTargetError(
            f"drafter {drafter.name} needs {' and '.join(missing)} of the target; {target.name} "
            f"does not offer it (the native runtime does; this model is loaded through another)"
        )
    drafter.check(target)
