"""The engine: several requests decoded together, joining and leaving between steps (continuous batching)."""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Callable

import torch

from verispec.argument_checks import generation_args, whole_number
from verispec.cost_model import Acceptance, Costs
from verispec.detokenize import TextTracker
from verispec.drafters.base import Drafter, Proposal, Verdict, check_target
from verispec.drafters.batch import SequenceStart
from verispec.engine.batch_step import SequenceStep, batched_step
from verispec.engine.draft_length import DraftLength
from verispec.engine.kv_budget import KVBudget
from verispec.engine.request import Request, Update
from verispec.engine.request_state import RequestState
from verispec.errors import DrafterError, InvalidArgumentError
from verispec.grammar import bind
from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams, seeded_generator
from verispec.stats import EngineMetrics
from verispec.tree import cut_after_eos

PREFILL_ROWS = 512  # the most prompt tokens one prefill forward runs: its activations grow with them, and on a
# server many prompts join at once (a row's result does not depend on the rows beside it, so this bounds memory only)
POOLED_WEIGHT = 4.0  # tries of its own that the pooled acceptance counts for, as a new sequence's prior


class Engine:
    """Decodes up to `max_batch` requests at a time, one target forward per step for all of them; the rest wait for
    a free slot. Each request keeps its own length, drafts, acceptance, rollback, sampling settings, seed and stops,
    and decodes to what `verispec.generate` gives it alone (token for token under greedy decoding).

    `drafter`: one that declares `batched` (the draft model's chains, prompt lookup, or `AdaptiveK` over either);
    its `k` is the most a step drafts. `adaptive` (default): each step's k is chosen from the batch size and the
    measured costs (`engine.draft_length`), 0 when plain decoding is faster; otherwise every step drafts `k`.
    `costs(B)` fixes (c, r) per batch size instead of measuring them. Single-threaded: the caller runs `add`,
    `abort` and `step` from one thread.
    """

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None = None,
        *,
        max_batch: int = 16,
        adaptive: bool = True,
        costs: Callable[[int], Costs] | None = None,
        context: int | None = None,
        kv_memory: int | None = None,
    ) -> None:
        self.max_batch = whole_number(max_batch, "max_batch", 1)
        if not target.capabilities.batching:
            raise InvalidArgumentError(
                f"target {target.name} cannot decode a batch: the engine needs the native "
                "runtime (not the transformers adapter), in exact mode on verispec's kernels "
                "only (--no-exact elsewhere)"
            )
        if drafter is not None:
            if not getattr(drafter, "batched", False):  # undeclared means not batched
                raise InvalidArgumentError(
                    f"drafter {drafter.name} does not batch yet; the engine drafts chains "
                    "with a native draft model (selfquant's twin too), prompt lookup or suffix "
                    "decoding, or decodes plainly"
                )
            check_target(drafter, target)
        self.target, self.drafter = target, drafter
        context, memory = KVBudget.context_for(target.context_length, context), KVBudget.memory(kv_memory)
        self.cache = target.new_batch_cache(self.max_batch, context, memory=memory)
        self.budget = KVBudget(context, memory // self.cache.bytes_per_position, self.cache.bytes_per_position)
        self.drafts = None if drafter is None else drafter.begin_batch(target, self.max_batch)
        self.max_k = 0 if drafter is None else drafter.k
        self.draft_length = DraftLength(self.max_k, costs) if drafter is not None and adaptive else None
        self.metrics = EngineMetrics(exact=self.cache.exact, kv_budget_bytes=memory)
        self._pooled = Acceptance(max(1, self.max_k))  # every sequence's verdicts
        self._next_id = 0
        self._free = list(range(self.max_batch))  # a heap: the lowest free slot first keeps the batch contiguous
        self._waiting: deque[RequestState] = deque()
        self._running: dict[int, RequestState] = {}
        self._dropped: list[RequestState] = []  # aborted while waiting: their last update is due

    @property
    def last_k(self) -> int:
        """The draft length chosen for the last step (0: plain decoding)."""
        return self.metrics.last_k

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._dropped)

    def add(self, request: Request) -> int:
        """Check `request` and queue it; returns its id. It joins the batch at the next step with a free slot."""
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"expected a verispec.engine.Request, got {type(request).__name__}")
        if not isinstance(request.sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be a SamplingParams, got {type(request.sampling).__name__}")
        prompt, limit, seed, stop = generation_args(
            self.target, request.prompt, max_new_tokens=request.max_new_tokens, seed=request.seed, stop=request.stop
        )
        positions = self.budget.need(len(prompt), limit, self.max_k)  # refused here if it could never fit
        grammar = bind(request.grammar, self.target, request.ignore_eos)
        generator = seeded_generator(self.target.device, seed)  # as `generate` seeds it
        eos = frozenset() if request.ignore_eos else self.target.eos_token_ids
        sequence = RequestState(
            self._next_id,
            request,
            eos,
            TextTracker(self.target.tokenizer, prompt, stop),
            generator,
            None if grammar is None else grammar.start(),
            list(prompt),
            len(prompt),
            positions=positions,
        )
        self._next_id += 1
        self._waiting.append(sequence)
        self.metrics.waiting = len(self._waiting)
        return sequence.id

    def abort(self, request_id: int) -> None:
        """End a request at the next step (its last update says "aborted"); one that already ended is left as it is."""
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
        """Admit waiting requests into free slots, then one batched draft + verify step for every running one;
        returns an update for each request that committed tokens, released text or ended."""
        start = time.perf_counter()
        for sequence in self._running.values():
            if sequence.abort_asked and sequence.finish_reason is None:
                sequence.finish_reason = "aborted"
        self._admit()
        live = [s for s in self._running.values() if s.finish_reason is None]
        if live:
            self._decode(live)
        updates = [u for s in self._dropped if (u := s.update()) is not None]
        self.metrics.finished += len(self._dropped)
        self._dropped = []
        for sequence in list(self._running.values()):
            update = sequence.update()
            if update is not None:
                updates.append(update)
            if sequence.finish_reason is not None:
                self._release(sequence)
        self.metrics.running, self.metrics.waiting = len(self._running), len(self._waiting)
        self.metrics.kv_reserved_bytes = self.budget.reserved * self.budget.bytes_per_position
        self.metrics.kv_bytes = self.cache.nbytes
        self.metrics.decode_seconds += time.perf_counter() - start
        return updates

    def _admit(self) -> None:
        """Give waiting requests free slots and prefill them together: each prompt but its last token."""
        joining = []
        while self._waiting and self._free and self.budget.fits(self._waiting[0].positions):  # else it waits for room
            sequence = self._waiting.popleft()
            sequence.slot = heapq.heappop(self._free)
            self.cache.open(sequence.slot, sequence.positions)
            self.budget.take(sequence.positions)
            # Its acceptance starts from what the drafter has been getting lately, worth a few of its own tries
            # (deeper positions, as always, from the estimate before them).
            sequence.acceptance = Acceptance(max(1, self.max_k), self._pooled.rates()[0], POOLED_WEIGHT)
            self._running[sequence.id] = sequence
            joining.append(sequence)
        if not joining:
            return
        t0, drafting = time.perf_counter(), []
        try:
            self._prefill([s for s in joining if len(s.tokens) > 1])
            for s in joining:
                if self.drafts is not None:
                    self.drafts.add(s.slot, SequenceStart(list(s.tokens), s.request.sampling, s.generator, s.grammar))
                    drafting.append(s)
                s.stats.prefill_time = time.perf_counter() - t0
        except BaseException:  # back to the queue, as if they had not joined
            for s in joining:
                self.cache.truncate(s.slot, 0)
                self.budget.give(s.positions)
                if s in drafting:
                    self.drafts.remove(s.slot)
                del self._running[s.id]
                heapq.heappush(self._free, s.slot)
            self._waiting.extendleft(reversed(joining))
            raise

    def _decode(self, live: list[RequestState]) -> None:
        """One step for the live sequences: choose k, draft, verify in one forward, commit. A sequence whose own part
        fails (its draft, its acceptance rule, its text) ends with that error; the others step as they would alone."""
        context = self.budget.context
        limits = [min(self.max_k, s.room(context) - 1) for s in live]
        if self.draft_length is not None:
            k = self.draft_length.choose(
                [s.acceptance.rates() for s in live], limits, lambda width: self._time_forward(live, width)
            )
        else:
            k = self.max_k
        asked = {s.slot: min(k, limit) for s, limit in zip(live, limits) if min(k, limit) >= 1}
        failed: dict[int, Exception] = {}  # slot -> what ended that sequence
        t0 = time.perf_counter()
        try:
            proposals = self._propose(live, asked, failed)
            t1 = time.perf_counter()
            members, rows = [], []
            for s in live:
                proposal = proposals.get(s.slot, Proposal([]))
                try:
                    _check(self.drafter, proposal, asked.get(s.slot, 0))
                except DrafterError as err:
                    failed[s.slot] = err
                if s.slot not in failed:
                    members.append(s)
                    rows.append(
                        SequenceStep(
                            s.slot,
                            s.tokens[-1],
                            cut_after_eos(proposal, s.eos)[0],
                            s.request.sampling,
                            s.generator,
                            s.grammar,
                        )
                    )
            results = batched_step(self.target, self.cache, rows) if rows else []
            failed |= {row.slot: r for row, r in zip(rows, results) if isinstance(r, Exception)}
            if asked:
                self.drafts.accepted(
                    {
                        row.slot: Verdict(list(range(r[0])))
                        for row, r in zip(rows, results)
                        if row.slot in asked and row.slot not in failed
                    }
                )
        except BaseException:  # every slot back to its committed tokens, so the engine can go on
            for s in live:
                self.cache.truncate(s.slot, min(self.cache.lengths[s.slot], len(s.tokens) - 1))
                if self.drafts is not None:
                    self.drafts.rollback(s.slot, len(s.tokens))
            raise
        t2 = time.perf_counter()
        done = [(s, row, r) for s, row, r in zip(members, rows, results) if s.slot not in failed]
        if self.draft_length is not None and rows:
            self.draft_length.observe(
                len(live),
                k,
                t1 - t0,
                1 + max(len(r.proposal.tokens) for r in rows),
                t2 - t1,
                any(n for _, _, (n, _) in done),
            )
        for s, row, (n, token) in done:
            stats = s.stats
            stats.draft_time, stats.verify_time = stats.draft_time + t1 - t0, stats.verify_time + t2 - t1
            stats.target_calls += 1
            stats.drafter_calls += s.slot in asked
            s.acceptance.observe(len(row.proposal.tokens), n)
            self._pooled.observe(len(row.proposal.tokens), n)
            before = len(s.tokens)
            try:
                self.metrics.accepted_tokens += s.commit(row.proposal.tokens, n, token, context)
            except Exception as err:  # its text (a tokenizer's decode) failed
                failed[s.slot] = err
            self.metrics.drafted_tokens += len(row.proposal.tokens)
            self.metrics.generated_tokens += len(s.tokens) - before
        for s in live:
            if s.slot in failed:
                s.fail(failed[s.slot])
                self.metrics.failed += 1
        self.metrics.record_step(k, len(live))

    def _propose(self, live: list[RequestState], asked: dict[int, int], failed: dict[int, Exception]) -> dict:
        """The drafter's proposals for the `asked` slots. Where the batch's drafting raises, each slot drafts again
        alone, so that only the sequences whose drafts fail (recorded in `failed`) end."""
        if not asked:
            return {}
        contexts = {s.slot: s.tokens for s in live if s.slot in asked}
        try:
            return self.drafts.propose(contexts, asked)
        except Exception as err:
            for slot in asked:
                self.drafts.rollback(slot, len(contexts[slot]))
            if len(asked) == 1:
                failed[next(iter(asked))] = err
                return {}
        proposals = {}
        for slot, k in asked.items():
            try:
                proposals |= self.drafts.propose({slot: contexts[slot]}, {slot: k})
            except Exception as err:
                self.drafts.rollback(slot, len(contexts[slot]))
                failed[slot] = err
        return proposals

    def _prefill(self, prefill: list[RequestState]) -> None:
        """Each sequence's prompt but its last token into its slot, in forwards of at most about PREFILL_ROWS real
        tokens: a window of the prompts' columns at a time, over the prompts that still have tokens there."""
        device = self.target.device
        start, end = 0, max((len(s.tokens) - 1 for s in prefill), default=0)
        while start < end:
            rows = [s for s in prefill if len(s.tokens) - 1 > start]
            width = max(1, PREFILL_ROWS // len(rows))
            counts = [min(len(s.tokens) - 1 - start, width) for s in rows]
            x = torch.zeros(len(rows), max(counts), dtype=torch.long, device=device)
            for b, s in enumerate(rows):
                x[b, : counts[b]] = torch.tensor(s.tokens[start : start + counts[b]], device=device)
            self.target.forward_batch(x, self.cache, [s.slot for s in rows], counts, logits=False)
            start += width

    def _time_forward(self, live: list[RequestState], width: int) -> float | None:
        """Seconds of one target forward of `width` tokens per row over the live sequences' slots; the slots are
        rolled back after it (what it wrote lies past their lengths, never read). None where a slot lacks room."""
        slots = [s.slot for s in live]
        if any(self.cache.lengths[s.slot] + width > s.positions for s in live):
            return None
        lengths = [self.cache.lengths[slot] for slot in slots]
        x = torch.zeros(len(slots), width, dtype=torch.long, device=self.target.device)
        start = time.perf_counter()
        self.target.forward_batch(x, self.cache, slots, [width] * len(slots))
        seconds = time.perf_counter() - start
        for slot, length in zip(slots, lengths):
            self.cache.truncate(slot, length)
        return seconds

    def _release(self, sequence: RequestState) -> None:
        del self._running[sequence.id]
        self.cache.truncate(sequence.slot, 0)
        self.budget.give(sequence.positions)
        if self.drafts is not None:
            self.drafts.remove(sequence.slot)
        heapq.heappush(self._free, sequence.slot)
        self.metrics.finished += 1


def _check(drafter: Drafter | None, proposal: Proposal, k: int) -> None:
    """A batch drafter proposes chains at most k deep: anything else would not fit the step's forward."""
    if proposal.parents is not None or proposal.side is not None or len(proposal.tokens) > k:
        raise DrafterError(
            f"drafter {drafter.name} proposed {len(proposal.tokens)} tokens (a tree or side branch: "
            f"{proposal.parents is not None or proposal.side is not None}); a batch step takes a "
            f"chain of at most {k}"
        )
