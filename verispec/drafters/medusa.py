"""Medusa drafting (Cai et al. 2024): heads on the target's feature of the last token it scored propose a token tree.

From f_{n-2}, the target's feature at the token before the last committed one (its LM head chose that last token),
head i's ranked guesses are for position n + i. The tree is a fixed set of rank paths chosen from the heads' measured
accuracy (`models.medusa.best_paths`): path (r1, ..., rd) is head 0's r1-th best token, then head 1's r2-th best, and
so on. All nodes are verified in one target forward. The candidates are fixed, not sampled, so under sampling they go
with one-hot q and SpecInfer's rule (draws without replacement from p) keeps the target's distribution.
"""

from __future__ import annotations

from typing import Sequence

import torch

from verispec.argument_checks import whole_number
from verispec.drafters.base import DraftContext, Needs, Proposal, Verdict
from verispec.errors import IncompatibleTargetError
from verispec.heads.medusa import MedusaHeads, best_paths
from verispec.models.protocol import FINAL, CausalLM

# Until a head's accuracy is measured, rank r of head i is taken to be right 0.6 * 0.7**i / (r + 1) of the time:
# deeper heads and lower ranks are worth less, which is the shape every measured Medusa table has.
RANKS = 4
# Four nodes: a forward's cost rises with its rows once the matmuls stop being bound by reading the weights, and the
# heads' deeper guesses are accepted too seldom to pay for their rows (the shipped heads' card has their acceptance
# by depth).
TREE_TOKENS = 4


def assumed_accuracy(heads: int) -> list[list[float]]:
    return [[0.6 * 0.7**i / (r + 1) for r in range(RANKS)] for i in range(heads)]


class Medusa:
    name = "medusa"
    batched = False  # its trees are verified through a per-sequence tree mask
    needs = Needs(hidden_states=(FINAL,), tree_masks=True)

    def __init__(
        self,
        heads: MedusaHeads,
        accuracy: list[list[float]] | None = None,
        tokens: int = TREE_TOKENS,
        vocab: torch.Tensor | None = None,
    ) -> None:
        self.heads = heads
        table = assumed_accuracy(heads.num_heads) if accuracy is None else accuracy[: heads.num_heads]
        self.paths = best_paths(table, whole_number(tokens, "tree tokens", 1))
        self.k = max(len(p) for p in self.paths)
        self.width = len(self.paths)
        self.vocab = None if vocab is None else vocab.to(torch.long)
        self.lm_heads = None if self.vocab is None else heads.lm_head_rows(self.vocab)

    def check(self, target: CausalLM) -> None:
        if (self.heads.hidden, self.heads.vocab) != (target.hidden_size, target.lm_head_weight.shape[0]):
            raise IncompatibleTargetError(
                f"these Medusa heads read features of {self.heads.hidden} over a vocabulary "
                f"of {self.heads.vocab}; {target.name} has {target.hidden_size} and "
                f"{target.lm_head_weight.shape[0]}"
            )

    def begin(self, context: DraftContext) -> MedusaSession:
        return MedusaSession(self, context)


class MedusaSession:
    def __init__(self, drafter: Medusa, context: DraftContext) -> None:
        self.heads, self.paths, self.vocab, self.lm_heads = (
            drafter.heads,
            drafter.paths,
            drafter.vocab,
            drafter.lm_heads,
        )
        self.vocab_size = context.target.vocab_size
        self.ranks = 1 + max(r for p in self.paths for r in p)
        self.feature = context.hidden[-1, 0] if len(context.hidden) else None  # f_{n-2}: the last one scored

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if self.feature is None:  # a one-token prompt: nothing scored yet
            return Proposal([])
        logits = self.heads(self.feature, self.lm_heads)  # (heads, V or |subset|)
        if self.vocab is None:
            logits = logits[:, : self.vocab_size]
        ranked = logits.topk(min(self.ranks, logits.shape[-1]), dim=-1).indices  # (heads, ranks)
        if self.vocab is not None:
            ranked = self.vocab[ranked]
        index: dict[tuple[int, ...], int] = {(): -1}
        tokens, parents = [], []
        for path in self.paths:  # sorted by depth: a path's prefix comes first
            if len(path) > k or path[-1] >= ranked.shape[1] or path[:-1] not in index:
                continue
            index[path] = len(tokens)
            tokens.append(int(ranked[len(path) - 1, path[-1]]))
            parents.append(index[path[:-1]])
        return Proposal(tokens, None, parents)

    def accepted(self, verdict: Verdict) -> None:
        """The feature of the last accepted token (or of the root, when none was) drafts the next tree."""
        self.feature = verdict.hidden[-1, 0]
