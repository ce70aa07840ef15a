"""The Drafter protocol: every method of proposing tokens plugs into the generation loop through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from verispec.models.protocol import Cache, CausalLM
from verispec.sampling import SamplingParams


@dataclass(frozen=True)
class SideBranch:
    """Tokens scored in the same target forward as the proposal but never accepted (lookahead's Jacobi window).

    Each sees the committed text, the last committed token and the side tokens its `mask` row allows;
    none sees the proposal's tokens, nor they it.
    """

    tokens: list[int]
    offsets: list[int]  # rotary position of each, counted from the last committed token's (>= 1)
    mask: torch.Tensor  # (S, S) bool: True where side token i attends to side token j


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    # q (len(tokens), V) where the drafter sampled; None counts as one-hot. In a tree, sampled siblings must be
    # independent draws (with replacement) from their shared q, which SpecInfer's rule needs to stay lossless.
    probs: torch.Tensor | None = None
    # A token tree: each token's parent index, -1 for the last committed token; parents come before their
    # children, siblings in the order they are tried. None: the tokens form one chain.
    parents: list[int] | None = None
    side: SideBranch | None = None


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # indices of the accepted proposal tokens, root to leaf (a chain: 0, 1, ..., n - 1)
    side_logits: torch.Tensor | None = None  # (S, V) the target's logits at the side branch's tokens

    @property
    def num_accepted(self) -> int:
        return len(self.path)


class Drafter(Protocol):
    name: str
    k: int  # the deepest proposal: at most this many tokens can be accepted per step
    width: int  # the most tokens one proposal puts into the target's forward (tree nodes and side branch)

    def begin(self, target: CausalLM, prompt: Sequence[int], sampling: SamplingParams,
              generator: torch.Generator, cache: Cache) -> None:
        """Start a new sequence for this target (drop any state from an earlier one).

        `cache` is the target's: at each `propose` it holds every committed token but the last. A drafter
        that runs the target itself (layer skip) may write past that and must truncate back before returning.
        """

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        """Tokens to follow `context` (every token committed so far), at most k deep."""

    def accepted(self, verdict: Verdict) -> None:
        """The target's verdict on the last proposal; roll back any state past the accepted tokens."""
