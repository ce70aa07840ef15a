"""What a forward is asked for, besides its tokens: one small record instead of loose parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass(eq=False)
class VocabHead:
    """An LM head over part of the vocabulary (a drafter's reduced vocabulary, as in FR-Spec and EAGLE-3): logits for
    the tokens `ids` only, in that order, for a fraction of the full head's cost (`LlamaForCausalLM.vocab_head`)."""

    ids: torch.Tensor  # (N,) int64 token ids
    matmul: nn.Module  # final-normed states (..., D) -> (..., N)


@dataclass(frozen=True)
class ForwardOptions:
    """A forward of T new tokens after a cache's `length` positions (or, with no cache, of a whole sequence).

    `mask` (T, T), True where new token i may attend to new token j, replaces the causal pattern among the new
    tokens, each of which sees the whole cache; a mask (T, length + T) covers the cache too. `positions` (T,) are the
    rotary positions, length + index by default (a token tree passes length + depth). `layers` (ascending) are the
    blocks to run, all by default: a skipped block neither computes nor writes its cache entries. `hidden` (block
    indices, or -1 for the final-normed state) asks for the residual stream after each. `logits_from`: the first row
    whose logits are computed (T: none; the head is skipped). `head`: logits over its tokens only.
    """

    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    layers: Sequence[int] | None = None
    hidden: Sequence[int] | None = None
    logits_from: int = 0
    head: VocabHead | None = None

    @staticmethod
    def keeping(logits_to_keep: int, T: int) -> int:
        """`logits_from` for a forward of T tokens asked for the logits of its last `logits_to_keep` (0: all), as
        transformers counts them."""
        return max(T - logits_to_keep, 0) if logits_to_keep else 0
