"""EAGLE drafting (Li et al. 2024): a one-layer head autoregresses on the target's own features.

The loop hands the session the target's final-normed feature f_i of every committed token but the last. The head
reads (f_i, embedding of x_{i+1}) and predicts f_{i+1}, whose logits (through the target's LM head) give the next
draft token; drafting goes on from its own predicted features. The head keeps a KV cache over the committed
positions only: entries built from predicted features are cut after every verdict, and the true features that the
verdict brings are fed at the next proposal.

`vocab` (optional) restricts the draft's LM head to a subset of frequent tokens (as FR-Spec and EAGLE-3 do): the
8192-wide LM head is most of the head's cost on a small target, and verification stays exact because the target
still scores the full vocabulary; a token outside the subset is simply never proposed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from verispec.arguments import whole_number
from verispec.drafters.base import DraftContext, Needs, Proposal, Verdict
from verispec.errors import IncompatibleTargetError
from verispec.models.eagle import EagleHead
from verispec.models.protocol import FINAL, CausalLM
from verispec.sampling import draw


class Eagle:
    name = "eagle"
    needs = Needs(hidden_states=(FINAL,))

    def __init__(self, head: EagleHead, k: int = 4, vocab: torch.Tensor | None = None) -> None:
        self.head, self.k = head, whole_number(k, "k (tokens drafted per step)", 1)
        self.width = self.k
        self.vocab = None if vocab is None else vocab.to(torch.long)

    def check(self, target: CausalLM) -> None:
        c = self.head.config
        if (c.hidden_size, c.vocab_size) != (target.hidden_size, target.lm_head_weight.shape[0]):
            raise IncompatibleTargetError(f"this EAGLE head has features of {c.hidden_size} and a vocabulary of "
                                          f"{c.vocab_size}; {target.name} has {target.hidden_size} and "
                                          f"{target.lm_head_weight.shape[0]}")

    def begin(self, context: DraftContext) -> EagleSession:
        return EagleSession(self, context)


class EagleSession:
    def __init__(self, drafter: Eagle, context: DraftContext) -> None:
        self.head, self.target = drafter.head, context.target
        self.sampling, self.generator = context.sampling, context.generator
        weight = self.target.lm_head_weight
        self.vocab = drafter.vocab
        self.lm_head = weight if self.vocab is None else weight[self.vocab]  # (V or |subset|, D), taken once
        self.cache = self.head.new_cache(context.cache.max_len + drafter.k, weight.dtype, weight.device)
        self.features = context.hidden[:, 0]  # (n, D): committed features not yet fed to the head
        self._committed = len(context.prompt)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Proposal:
        """Feed the new true features with their next tokens, then draft k tokens from predicted features."""
        fed, n = self.cache.length, len(context)
        self._committed = n
        k = min(k, self.cache.max_len - (n - 1))
        if k < 1 or fed + len(self.features) == 0:  # nothing to predict from yet (a one-token prompt)
            return Proposal([])
        nxt = torch.tensor(context[fed + 1: n], device=self.features.device)  # x_{i+1} for each fed feature
        predicted = self.head(self.features[None], self.target.embed(nxt)[None], self.cache)[0, -1]
        self.features = self.features[:0]
        tokens, q = [], []
        for i in range(k):
            token, q_i = self._draw(predicted)
            tokens.append(token)
            q += [] if q_i is None else [q_i]
            if i < k - 1:  # (f^, the token just drafted) predicts the next feature
                embedding = self.target.embed(torch.tensor([[token]], device=predicted.device))
                predicted = self.head(predicted[None, None], embedding, self.cache)[0, -1]
        return Proposal(tokens, torch.stack(q) if q else None)

    def _draw(self, feature: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft token (in the target's ids) and its q over the full vocabulary when sampling."""
        logits = F.linear(feature, self.lm_head)
        if self.vocab is None:
            return draw(logits[: self.target.vocab_size], self.sampling, self.generator)
        full = torch.full((self.target.vocab_size,), float("-inf"), dtype=logits.dtype, device=logits.device)
        full[self.vocab] = logits  # outside the subset q is zero
        return draw(full, self.sampling, self.generator)

    def accepted(self, verdict: Verdict) -> None:
        """Entries built from predicted features go; the verdict's true features wait for the next proposal."""
        self.cache.truncate(min(self.cache.length, self._committed - 1))
        self.features = torch.cat((self.features, verdict.hidden[:, 0]))
