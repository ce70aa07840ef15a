"""Drafting by re-encoding (vocab_map reencode, cross_vocab.py): a draft with its own tokenizer writes text greedily in
its tokens, and the target is proposed that text in the target's tokens."""

from __future__ import annotations

from typing import Sequence

import torch

from verispec.drafters.base import Proposal, Verdict
from verispec.drafters.cross_vocab import DraftWindow, Translation
from verispec.models.forward_options import VocabHead
from verispec.models.protocol import CausalLM
from verispec.retokenize import DraftText
from verispec.sampling import argmax


class ReencodeSession:
    """The draft reads the committed text in its own tokens (`DraftText`, within its context length) and continues it
    greedily by one token more than asked: the last draft token's text may still merge with what follows it, so the
    proposal is its text's target tokens up to there (`Translation.proposal`), at most k of them.

    The proposal is the same whatever the sampling settings: a guess that the committed text fixes, verified with a
    one-hot q (no q: the loop's default), which keeps the output exact under greedy decoding and sampling alike. A
    grammar's forbidden tokens are cut from it by the loop. The draft's cache holds what it was fed, whatever the
    verdict: the next `propose` cuts it back to where the re-encoded committed text first differs."""

    def __init__(self, model: CausalLM, head: VocabHead | None, translation: Translation, k: int) -> None:
        """`model` drafts (over the draft vocabulary `head`, if given) at most k target tokens a step."""
        self.model, self.head, self.translation = model, head, translation
        self.cache = self.model.new_cache(self.model.context_length)
        # ids + the k + 1 drafted tokens but the last must fit the cache
        self.window = DraftWindow(DraftText(translation.target.table, translation.draft), self.cache.max_len - k - 1)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        ids = self.window.sync(self.cache, context)
        n = min(k + 1, self.cache.max_len - len(ids) + 1)  # draft tokens; the cache keeps all but the last
        if k < 1 or not ids or n < 2:
            return Proposal([])
        unseen = torch.tensor([ids[self.cache.length :]], device=self.model.device)
        drafted = self._chain(unseen, n)
        self.window.fed = ids + drafted[:-1]
        return Proposal(self.translation.proposal(drafted)[:k])

    def _chain(self, unseen: torch.Tensor, n: int) -> list[int]:
        """n tokens of the draft's greedy decoding after `unseen` (over its draft vocabulary, if it has one)."""
        if self.model.capabilities.greedy_chains:
            return self.model.greedy_chain(unseen, self.cache, n, self.head)
        out, x = [], unseen
        while len(out) < n:
            if self.head is None:
                out.append(int(argmax(self.model(x, self.cache, logits_to_keep=1)[0, -1, : self.model.vocab_size])))
            else:
                logits = self.model(x, self.cache, head=self.head, logits_to_keep=1)[0, -1]
                out.append(int(self.head.ids[argmax(logits)]))
            x = torch.tensor([out[-1:]], device=self.model.device)
        return out

    def accepted(self, verdict: Verdict) -> None:
        """Nothing to roll back yet: the next `propose` compares the cache with the committed text."""
