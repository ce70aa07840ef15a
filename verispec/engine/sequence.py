"""One request's state inside the engine: its committed tokens, text, stats and stop, and what it has not reported."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verispec.adaptive import Acceptance
from verispec.detokenize import TextTracker
from verispec.engine.request import Request, Update
from verispec.stats import GenerationStats
from verispec.tree import through_eos


@dataclass
class Sequence:
    """The bookkeeping `verispec.generate` does around each step, for one request of the batch."""

    id: int
    request: Request
    eos: frozenset[int]
    text: TextTracker
    generator: torch.Generator
    tokens: list[int]  # the prompt, then every committed token
    acceptance: Acceptance  # its acceptance by draft position, which the step's k is chosen from
    slot: int = -1  # its cache slot while it runs
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None
    abort_asked: bool = False
    _tokens: list[int] = field(default_factory=list)  # committed since the last update
    _drafted: list[bool] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    def room(self, context_length: int) -> int:
        """How many more tokens it may commit: its budget, and the context."""
        return min(self.request.max_new_tokens - self.generated, context_length - len(self.tokens))

    def commit(self, proposal: list[int], accepted: int, next_token: int, context_length: int) -> int:
        """The verdict on a chain `proposal`: its first `accepted` tokens and the target's `next_token`, cut at an
        end-of-sequence token or a stop string as `generate` cuts them; ends the sequence when it stops or has no
        room left. Returns the number of proposal tokens that were kept."""
        new, drafted = [*proposal[:accepted], next_token], [True] * accepted + [False]
        cut = through_eos(new, self.eos)  # nothing after an end-of-sequence token is kept
        if new[cut - 1] in self.eos:
            new, drafted, self.finish_reason = new[:cut], drafted[:cut], "eos"
        new = new[: self.text.add(new, drafted)]
        if self.text.stopped:
            self.finish_reason = "stop_string"
        kept = sum(drafted[: len(new)])  # a draft cut by a stop is not accepted
        self.stats.record_step(len(proposal), kept)
        self.tokens += new
        self.stats.new_tokens += len(new)
        self._tokens += new
        self._drafted += drafted[: len(new)]
        if self.finish_reason is None and self.room(context_length) <= 0:
            full = self.generated >= self.request.max_new_tokens
            self.finish_reason = "max_new_tokens" if full else "context_length"
        return kept

    def update(self) -> Update | None:
        """What happened since the last update (None if nothing did); the last one releases all the text."""
        finished = self.finish_reason is not None
        pieces = self.text.ready(final=finished)
        if not (pieces or self._tokens or finished):
            return None
        if finished:
            self.stats.total_time = time.perf_counter() - self.started
        update = Update(self.id, "".join(p.text for p in pieces), self._tokens, finished, self.finish_reason,
                        self.stats, self._drafted)
        self._tokens, self._drafted = [], []
        return update
