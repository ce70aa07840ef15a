"""What a drafter proposes and what verification says of it: the records a speculative step passes between the
drafter (drafters/base.py), the grammar's check (constraint.py), the acceptance rules (verify.py, tree.py) and the
loop (step.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # q (len(tokens), V): the draft's probabilities where it sampled; None counts as one-hot. In a tree, sampled
    # siblings must be independent draws (with replacement) from their shared q, as SpecInfer's rule needs.
    q: torch.Tensor | None = None
    # A token tree: each token's parent index, -1 for the last committed token; parents come before their
    # children, siblings in the order they are tried. None: the tokens form one chain.
    parents: list[int] | None = None
    side: SideBranch | None = None
    # Each token's estimated chance of being accepted, its path from the last committed token with it, where the
    # drafter knows one (suffix decoding's counts): adaptive k then cuts the proposal where it stops paying. In a
    # tree, nodes come in the order drawn, likeliest first, so every prefix is a tree (`tree.subset` of range(n)).
    confidence: list[float] | None = None


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # indices of the accepted proposal tokens, root to leaf (a chain: 0, 1, ..., n - 1)
    side_logits: torch.Tensor | None = None  # (S, V) the target's logits at the side branch's tokens
    # (1 + len(path), len(layers), D): the target's hidden states at the last committed token and at each accepted
    # token, for a drafter whose `needs.hidden_states` names layers; None otherwise.
    hidden: torch.Tensor | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.path)
