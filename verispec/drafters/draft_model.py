"""A smaller model of the same tokenizer drafts k tokens autoregressively, with its own KV cache."""

from __future__ import annotations

from typing import Sequence

import torch

from verispec.drafters.base import Proposal, Verdict
from verispec.errors import InvalidArgumentError, TokenizerMismatchError
from verispec.models.protocol import Cache, CausalLM
from verispec.sampling import SamplingParams, logits_to_probs, sample
from verispec.tokenizer import check_same_tokenizer


class DraftModel:
    """Its cache holds the committed tokens it has seen plus its own proposals, minus the last one.

    After the target's verdict it rolls back to the accepted tokens; the target's correction (and
    the last proposal, when everything was accepted) is fed at the start of the next `propose`,
    in the same forward as the first draft step.
    """

    name = "draft"

    def __init__(self, model: CausalLM, k: int = 4) -> None:
        if k < 1:
            raise InvalidArgumentError(f"k (tokens drafted per step) must be >= 1, got {k}")
        self.model, self.k, self.width = model, k, k
        self.cache: Cache | None = None
        self._context_len = 0

    def begin(self, target: CausalLM, prompt: Sequence[int], sampling: SamplingParams,
              generator: torch.Generator, cache: Cache) -> None:
        check_same_tokenizer(target.tokenizer, self.model.tokenizer, target.name, self.model.name)
        if self.model.vocab_size != target.vocab_size:
            raise TokenizerMismatchError(
                f"draft {self.model.name} has {self.model.vocab_size} usable tokens, target {target.name} {target.vocab_size}"
            )
        if self.cache is None:
            self.cache = self.model.new_cache()
        self.cache.truncate(0)
        self.sampling, self.generator, self._context_len = sampling, generator, len(prompt)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self._context_len = len(context)
        k = min(k, self.cache.max_len - len(context))  # the cache must hold context + k - 1 tokens
        if k < 1:
            return Proposal([])
        unseen = torch.tensor([context[self.cache.length:]], device=self.model.device)
        logits = self.model(unseen, self.cache)[0, -1, : self.model.vocab_size]
        tokens, probs = [], []
        for i in range(k):
            if self.sampling.greedy:
                token = int(logits.argmax())
            else:
                q = logits_to_probs(logits, self.sampling)
                token = int(sample(q, self.generator))
                probs.append(q)
            tokens.append(token)
            if i < k - 1:
                logits = self.model(torch.tensor([[token]], device=self.model.device), self.cache)[0, -1, : self.model.vocab_size]
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def accepted(self, verdict: Verdict) -> None:
        self.cache.truncate(min(self.cache.length, self._context_len + verdict.num_accepted))
