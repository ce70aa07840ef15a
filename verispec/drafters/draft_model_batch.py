"""The draft model drafting for the batched engine: each drafted position is one draft forward for every sequence."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from verispec.checkpoints.draft_vocab import spread
from verispec.drafters.base import Proposal, Verdict
from verispec.drafters.batch import SequenceStart
from verispec.models.forward_options import VocabHead
from verispec.models.protocol import CausalLM
from verispec.sampling import draw


class DraftModelBatch:
    """`DraftModelSession` for many sequences: the draft's cache has a slot per sequence, and every slot keeps that
    session's invariant (the committed tokens it has seen plus its own proposals, minus the last one; rolled back to
    the accepted tokens after each verdict; the target's token fed at the next `propose`, in the same forward as the
    first draft step). A sequence drafts the same tokens here as alone: the same draws from its own generator, in
    the same order; only the forward's arithmetic is batched."""

    def __init__(self, model: CausalLM, slots: int, head: VocabHead | None = None) -> None:
        self.model, self.head = model, head  # (an LM head over the draft vocabulary, if any: proposals among it only)
        # Each sequence's drafts (and their q) as alone, where the kernels run, so that sampling draws the same
        # whatever shares the batch
        self.cache = model.new_batch_cache(slots, model.context_length, exact=True)
        self._starts: dict[int, SequenceStart] = {}
        self._context_len: dict[int, int] = {}  # per slot: the context its last proposal followed

    def add(self, slot: int, start: SequenceStart) -> None:
        self._starts[slot] = start
        prompt = start.prompt
        if 1 < len(prompt) <= self.cache.max_len:  # a prompt that fills the draft's context never gets drafts
            x = torch.tensor([prompt[:-1]], device=self.model.device)
            self.model.forward_batch(x, self.cache, [slot], [len(prompt) - 1], logits=False)

    def propose(self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int]) -> dict[int, Proposal]:
        # As alone: the cache must hold context + k - 1 tokens, so k is cut where the draft's context ends.
        ks = {slot: min(k, self.cache.max_len - len(contexts[slot])) for slot, k in ks.items()}
        rows = [slot for slot, k in ks.items() if k >= 1]
        tokens: dict[int, list[int]] = {slot: [] for slot in ks}
        qs: dict[int, list[torch.Tensor]] = {slot: [] for slot in ks}
        if rows:
            unseen = [contexts[slot][self.cache.lengths[slot] :] for slot in rows]
            for slot in rows:
                self._context_len[slot] = len(contexts[slot])
            logits = self._forward(unseen, rows)
            while rows:
                ended = set()  # slots whose grammar allows nothing in the draft's vocabulary here
                for slot, row in zip(rows, logits):
                    start = self._starts[slot]
                    if start.grammar is not None and (row := start.grammar.constrain(row, tokens[slot])) is None:
                        ended.add(slot)
                        continue
                    token, q = draw(row, start.sampling, start.generator)
                    tokens[slot].append(token)
                    qs[slot] += [] if q is None else [q]
                rows = [slot for slot in rows if len(tokens[slot]) < ks[slot] and slot not in ended]
                if rows:
                    logits = self._forward([[tokens[slot][-1]] for slot in rows], rows)
        return {slot: Proposal(tokens[slot], torch.stack(qs[slot]) if qs[slot] else None) for slot in ks}

    def _forward(self, new: list[Sequence[int]], rows: list[int]) -> torch.Tensor:
        """One draft forward over each row's new tokens (right-padded); the logits (B, V) after each row's last."""
        counts = [len(tokens) for tokens in new]
        x = torch.zeros(len(rows), max(counts), dtype=torch.long, device=self.model.device)
        for b, tokens in enumerate(new):
            x[b, : len(tokens)] = torch.tensor(tokens, device=self.model.device)
        last = torch.tensor(counts, device=self.model.device) - 1
        if self.head is None:
            logits = self.model.forward_batch(x, self.cache, rows, counts)
            return logits[torch.arange(len(rows), device=self.model.device), last, : self.model.vocab_size]
        logits = self.model.forward_batch(x, self.cache, rows, counts, self.head)
        return spread(
            logits[torch.arange(len(rows), device=self.model.device), last], self.head.ids, self.model.vocab_size
        )

    def accepted(self, verdicts: Mapping[int, Verdict]) -> None:
        for slot, verdict in verdicts.items():
            if slot in self._context_len:
                length = self.cache.lengths[slot]
                self.cache.truncate(slot, min(length, self._context_len[slot] + verdict.num_accepted))

    def rollback(self, slot: int, committed: int) -> None:
        self.cache.truncate(slot, min(self.cache.lengths[slot], committed - 1))

    def remove(self, slot: int) -> None:
        self.cache.truncate(slot, 0)
        self._starts.pop(slot)
        self._context_len.pop(slot, None)
