"""One request's state inside the engine: its committed tokens, text, stats and stop, and what it has not reported."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verispec.commit import commit_step
from verispec.constraint import Constraint
from verispec.cost_model import Acceptance
from verispec.detokenize import TextTracker
from verispec.engine.request import Request, Update
from verispec.stats import GenerationStats


@dataclass
class RequestState:
    """The bookkeeping `verispec.generate` does around each step, for one request of the batch."""

    id: int
    request: Request
    eos: frozenset[int]
    text: TextTracker
    generator: torch.Generator
    grammar: Constraint | None  # the grammar's state after the committed tokens
    tokens: list[int]  # the prompt's ids, then every committed token
    prompt_length: int
    positions: int = 0  # the cache positions it reserves while it runs (engine/kv_budget.py)
    slot: int = -1  # its cache slot while it runs
    acceptance: Acceptance | None = None  # by draft position, which the step's k is chosen from; set when it joins
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None
    error: Exception | None = None  # what ended it, when finish_reason is "error"
    abort_asked: bool = False
    _tokens: list[int] = field(default_factory=list)  # committed since the last update
    _drafted: list[bool] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    def room(self, context_length: int) -> int:
        """How many more tokens it may commit: its budget, and the context."""
        return min(self.request.max_new_tokens - self.generated, context_length - len(self.tokens))

    def commit(self, proposal: list[int], accepted: int, next_token: int, context_length: int) -> int:
        """The verdict on a chain `proposal`: its first `accepted` tokens and the target's `next_token`, cut at an
        end-of-sequence token or a stop string as `generate` cuts them; ends the sequence when it stops or has no
        room left. Returns the number of proposal tokens that were kept."""
        committed = commit_step(
            [*proposal[:accepted], next_token],
            [True] * accepted + [False],
            len(proposal),
            self.eos,
            self.text,
            self.stats,
        )
        self.finish_reason = committed.stop_reason
        self.tokens += committed.tokens
        self._tokens += committed.tokens
        self._drafted += committed.drafted
        if self.finish_reason is None and self.room(context_length) <= 0:
            full = self.generated >= self.request.max_new_tokens
            self.finish_reason = "max_new_tokens" if full else "context_length"
        return sum(committed.drafted)

    def fail(self, error: Exception) -> None:
        """End this sequence alone: something in its own part of a step raised."""
        self.finish_reason, self.error = "error", error

    def update(self) -> Update | None:
        """What happened since the last update (None if nothing did); the last one releases all the text."""
        finished = self.finish_reason is not None
        pieces = self.text.ready(final=finished)
        if not (pieces or self._tokens or finished):
            return None
        if finished:
            self.stats.total_time = time.perf_counter() - self.started
        update = Update(
            self.id,
            "".join(p.text for p in pieces),
            self._tokens,
            finished,
            self.finish_reason,
            self.stats,
            self._drafted,
            self.error,
        )
        self._tokens, self._drafted = [], []
        return update
