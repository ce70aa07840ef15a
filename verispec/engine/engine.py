"""The engine: several requests decoded together, joining and leaving between steps (continuous batching)."""

from __future__ import annotations

import time
from collections import deque

import torch

from verispec.arguments import prompt_ids, seed_value, stop_strings, whole_number
from verispec.detokenize import TextTracker
from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal, Verdict, check_target
from verispec.engine.metrics import EngineMetrics
from verispec.engine.request import Request, Update
from verispec.engine.sequence import Sequence
from verispec.errors import InvalidArgumentError
from verispec.models.protocol import Cache, CausalLM
from verispec.sampling import SamplingParams
from verispec.step import speculative_step
from verispec.tree import cut_after_eos


class Engine:
    """Decodes up to `max_batch` requests at a time; the rest wait for a free slot. Single-threaded: the caller
    runs `add`, `abort` and `step` from one thread."""

    def __init__(self, target: CausalLM, drafter: Drafter | None = None, *, max_batch: int = 16) -> None:
        self.target, self.drafter = target, drafter
        self.max_batch = whole_number(max_batch, "max_batch", 1)
        if drafter is not None:
            if not getattr(drafter, "batched", False):  # undeclared means not batched
                raise InvalidArgumentError(f"drafter {drafter.name} does not batch yet; the engine drafts with the "
                                           "draft model (a chain) and prompt lookup (ngram), or decodes plainly")
            check_target(drafter, target)
        self.metrics = EngineMetrics()
        self._next_id = 0
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}
        self._state: dict[int, tuple[Cache, DraftSession | None]] = {}
        self._dropped: list[Sequence] = []  # aborted while waiting: their last update is due

    @property
    def last_k(self) -> int:
        return self.metrics.last_k

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._dropped)

    def add(self, request: Request) -> int:
        """Check `request` and queue it; returns its id. It joins the batch at a step with a free slot."""
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"expected a verispec.engine.Request, got {type(request).__name__}")
        if not isinstance(request.sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be a SamplingParams, got {type(request.sampling).__name__}")
        prompt = prompt_ids(self.target, request.prompt)
        whole_number(request.max_new_tokens, "max_new_tokens", 1)
        seed, stop = seed_value(request.seed), stop_strings(list(request.stop))
        generator = torch.Generator(self.target.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        eos = frozenset() if request.ignore_eos else self.target.eos_token_ids
        sequence = Sequence(self._next_id, request, eos, TextTracker(self.target.tokenizer, prompt, stop), generator,
                            list(prompt))
        self._next_id += 1
        self._waiting.append(sequence)
        self.metrics.waiting = len(self._waiting)
        return sequence.id

    def abort(self, request_id: int) -> None:
        """End a request at the next step (its last update says "aborted"); a request that already ended is left
        as it is."""
        for sequence in self._waiting:
            if sequence.id == request_id:
                self._waiting.remove(sequence)
                sequence.finish_reason = "aborted"
                self._dropped.append(sequence)
                self.metrics.waiting = len(self._waiting)
                return
        if request_id in self._running:
            self._running[request_id].abort_asked = True

    def step(self) -> list[Update]:
        """Admit waiting requests into free slots, then one draft + verify step for every running one; returns an
        update for each request that committed tokens, released text or ended."""
        start = time.perf_counter()
        updates = [u for s in self._dropped if (u := s.update()) is not None]
        self.metrics.finished += len(self._dropped)
        self._dropped = []
        for sequence in [s for s in self._running.values() if s.abort_asked]:
            sequence.finish_reason = "aborted"
        self._admit()
        live = [s for s in self._running.values() if s.finish_reason is None]
        if live:
            k = 0 if self.drafter is None else self.drafter.k
            for sequence in live:
                self._step_one(sequence, k)
            self.metrics.record_step(k, len(live))
        for sequence in list(self._running.values()):
            update = sequence.update()
            if update is not None:
                updates.append(update)
            if sequence.finish_reason is not None:
                self._release(sequence)
        self.metrics.running, self.metrics.waiting = len(self._running), len(self._waiting)
        self.metrics.decode_seconds += time.perf_counter() - start
        return updates

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            sequence = self._waiting.popleft()
            t0 = time.perf_counter()
            prompt = sequence.tokens
            cache = self.target.new_cache()
            if len(prompt) > 1:
                self.target(torch.tensor([prompt[:-1]], device=self.target.device), cache)
            session = None
            if self.drafter is not None:
                session = self.drafter.begin(DraftContext(self.target, list(prompt), sequence.request.sampling,
                                                          sequence.generator, cache))
            self._state[sequence.id] = (cache, session)
            self._running[sequence.id] = sequence
            sequence.stats.prefill_time = time.perf_counter() - t0
            if sequence.room(self.target.context_length) <= 0:
                sequence.finish_reason = "max_new_tokens"

    def _step_one(self, sequence: Sequence, k: int) -> None:
        cache, session = self._state[sequence.id]
        t0 = time.perf_counter()
        room = sequence.room(self.target.context_length)
        proposal, asked = Proposal([]), session is not None and room > 1 and k > 0
        if asked:
            proposal = session.propose(sequence.tokens, min(k, room - 1))
            sequence.stats.drafter_calls += 1
        proposal, kept = cut_after_eos(proposal, sequence.eos)
        t1 = time.perf_counter()
        step = speculative_step(self.target, cache, sequence.tokens[-1], proposal, sequence.request.sampling,
                                sequence.generator)
        if asked:
            session.accepted(Verdict([kept[i] for i in step.path]))
        stats = sequence.stats
        stats.draft_time, stats.verify_time = stats.draft_time + t1 - t0, stats.verify_time + time.perf_counter() - t1
        stats.target_calls += 1
        before = len(sequence.tokens)
        accepted = sequence.commit(proposal.tokens, len(step.path), step.next_token, self.target.context_length)
        self.metrics.generated_tokens += len(sequence.tokens) - before
        self.metrics.drafted_tokens += len(proposal.tokens)
        self.metrics.accepted_tokens += accepted

    def _release(self, sequence: Sequence) -> None:
        del self._running[sequence.id], self._state[sequence.id]
        self.metrics.finished += 1
