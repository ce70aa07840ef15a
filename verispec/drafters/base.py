"""The Drafter protocol: every method of proposing tokens plugs into the generation loop through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # q (len(tokens), V) where the drafter sampled; None counts as one-hot


class Drafter(Protocol):
    name: str
    k: int  # the most tokens it proposes per step

    def begin(self, target: CausalLM, prompt: Sequence[int], sampling: SamplingParams,
              generator: torch.Generator) -> None:
        """Start a new sequence for this target (drop any state from an earlier one)."""

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        """Up to k tokens to follow `context` (every token committed so far)."""

    def accepted(self, num_accepted: int) -> None:
        """The target kept this many of the last proposal's tokens; roll back any state past them."""
