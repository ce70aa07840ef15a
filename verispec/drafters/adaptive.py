"""Adaptive draft length (`-k auto`): `AdaptiveK` wraps any drafter, and each step drafts the k that the step's cost
model (verispec/cost_model.py) predicts to be fastest: the k in 0..drafter.k (and the loop's room) that maximises
E(k) / cost(k), k = 0 being a plain step, so it drafts only while the predicted speedup is above 1.

The session times the drafter's `propose` and the verification (from the proposal's return to the verdict, which is
the target's forward), and the loop's own work per step (from a verdict to the next proposal: commit, stops, text, the
drafter's bookkeeping). While k = 0 is best, it probes (k = 1; a tree or window drafter's full size) on the shared
schedule (`cost_model.Probes`); a probe's cost is the larger of its predicted one and what the last probe measured (a
draft model first reads every token decoded since it last drafted, which the per-step prices leave out), and after
an accepted probe the next step probes again, until the estimate says drafting pays or a probe fails. The drafting
time of the first drafting step, and of the first after plain steps, is not taken as a price: a draft model then also
reads the tokens it has not seen (the whole prompt, at first).

Proposals that are not plain chains (token trees, lookahead's window) keep their configured size: for them `auto`
chooses between that size and 0, priced at the median width of their recent proposals. k is chosen from past verdicts
and timings only, never from the current step's draws, so the output's distribution is untouched.

A drafter that estimates each token's chance of acceptance (`scores`: suffix decoding's counts, `Proposal.confidence`)
drafts its most, chain or tree, and the proposal is cut where the next token costs more than it is expected to yield
(`cost_model.best_prefix`), its estimates calibrated by what the target accepted of earlier ones
(`cost_model.Calibration`). Its tokens are fixed by the committed text, not drawn, so the cut too is made before the
step's draws.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable, Sequence

from verispec.cost_model import TIMING_WINDOW, Acceptance, Calibration, Costs, Probes, Timings, best_k, best_prefix
from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal, Verdict
from verispec.drafters.batch import BatchDraftSession
from verispec.models.protocol import CausalLM
from verispec.tree import depth, subset

AUTO_MAX_K = 8  # the most an `auto` chain drafts per step when built from a method record


class AdaptiveK:
    """`drafter` with its draft length chosen per step (see the module's notes); `drafter.k` is the most it drafts.

    `costs` fixes (c, r), or (c, r, s) with drafting's start, instead of measuring them (for tests, or a table
    measured elsewhere)."""

    def __init__(
        self, drafter: Drafter, costs: Costs | tuple[float, Callable[[int], float], float] | None = None
    ) -> None:
        self.drafter, self.fixed_costs = drafter, costs
        self.name, self.k, self.width, self.needs = drafter.name, drafter.k, drafter.width, drafter.needs
        self.batched = getattr(drafter, "batched", False)  # the engine chooses k itself and drafts with `drafter`
        self.scores = getattr(drafter, "scores", False)  # its proposals carry `confidence`: they are cut, not chosen
        # A chain's forward grows with k; a tree's or a side branch's keeps its configured width, so it is on or off.
        self.chain = drafter.width == drafter.k and not drafter.needs.tree_masks

    def check(self, target: CausalLM) -> None:
        self.drafter.check(target)

    def begin(self, context: DraftContext) -> AdaptiveSession:
        return AdaptiveSession(self, self.drafter.begin(context))

    def begin_batch(self, target: CausalLM, slots: int) -> BatchDraftSession:
        """The wrapped drafter's batch session: the batched engine chooses each step's k itself
        (`engine.draft_length`)."""
        return self.drafter.begin_batch(target, slots)


class AdaptiveSession:
    """Chooses each step's k, times the drafter and the verification, and learns from each verdict."""

    def __init__(self, adaptive: AdaptiveK, inner: DraftSession) -> None:
        self.inner, self.chain, self.k, self.width = inner, adaptive.chain, adaptive.k, adaptive.width
        self.scores, self.calibration, self._proposed = adaptive.scores, Calibration(), None
        self.fixed_costs = adaptive.fixed_costs
        self.acceptance, self.timings = Acceptance(adaptive.k), Timings()
        self.chosen: list[int] = []  # k asked of the drafter at each step (a scored drafter's: the depth kept)
        self.probes = Probes(repeat_accepted=True)
        self._next_probe: int | None = None  # while plain decoding pays, the plain_run of the next judgement
        self.on_widths: deque[int] = deque(maxlen=TIMING_WINDOW)  # tokens a tree or window drafter put in the forward
        self._pending: tuple[int, float, int, float] | None = None  # (drafted, draft seconds, width, when proposed)
        self._drafted_last = False  # whether the previous step drafted: if not, this one's drafting includes a catch-up
        self._probe_cost = 0.0  # what the last probe cost over a plain step, in plain steps (catching up included)
        self._verdict_at: float | None = None  # when the last verdict reached this session

    def choose(self, limit: int) -> int:
        """The k for the next step, at most `limit`."""
        if limit < 1:
            return 0
        if self._next_probe is not None and self.probes.plain_run + 1 < self._next_probe:
            self.probes.plain_run += 1  # plain steps leave the acceptance as it was: the choice stands until the probe
            return 0
        if not self.chain and not self.timings.verify and self.fixed_costs is None:
            return limit  # a tree or window drafter: measure its configured size once before judging it
        c, r, start = self._costs()
        choices = range(limit + 1) if self.chain else (0, limit)
        on = round(statistics.median(self.on_widths)) if self.on_widths else self.width  # a tree's usual size
        width = (lambda k: k) if self.chain else (lambda k: on if k else 0)
        overhead = 0.0 if self.fixed_costs else self.timings.overhead()
        k = best_k(self.acceptance.rates(), c, r, choices, width, overhead, start)
        self._next_probe = None
        if k > 0:
            self.probes.drafting()
            return k
        probe = 1 if self.chain else limit
        cost = max(start + probe * c + r(width(probe) + 1) - 1, self._probe_cost)  # over a plain step
        now, wait = self.probes.plain(cost)
        if now:
            return probe
        self._next_probe = int(wait) + 1  # the plain_run at which to judge (and probe) again
        return 0

    def _costs(self) -> tuple[float, Callable[[int], float], float]:
        return (*self.fixed_costs, 0.0)[:3] if self.fixed_costs else self.timings.costs()

    def cut(self, proposal: Proposal) -> Proposal:
        """A scored proposal's most paying prefix (the module's notes)."""
        if proposal.confidence is None or not proposal.tokens:
            return proposal
        _, r, _ = self._costs()
        overhead = 0.0 if self.fixed_costs else self.timings.overhead()
        chances = [self.calibration.chance(estimate) for estimate in proposal.confidence]
        n = best_prefix(chances, r, overhead)
        if n:
            self.probes.drafting()
        elif self.probes.plain(r(2) - 1)[0]:  # a probe: the estimates learn only from tokens verified
            n = 1
        return subset(proposal, list(range(n)))  # a prefix: parents come before their children

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if self._verdict_at is not None:
            self.timings.between.append(time.perf_counter() - self._verdict_at)
        k = k if self.scores else self.choose(k)
        start = time.perf_counter()
        proposal = self.inner.propose(context, k)
        if self.scores:
            proposal = self._proposed = self.cut(proposal)
            k = depth(proposal)
        self.chosen.append(k)
        now = time.perf_counter()
        side = 0 if proposal.side is None else len(proposal.side.tokens)
        self._pending = (depth(proposal), now - start, 1 + len(proposal.tokens) + side, now)
        return proposal

    def accepted(self, verdict: Verdict) -> None:
        if self._pending is not None:
            drafted, draft_seconds, width, proposed_at = self._pending
            self._pending, verify_seconds = None, time.perf_counter() - proposed_at
            # The first drafting step of the generation, or after plain steps, also feeds a draft model the tokens it
            # has not seen (the whole prompt, at first): not a price per drafted token.
            clean = drafted if self._drafted_last else 0
            self._drafted_last = drafted > 0
            self.timings.observe(clean, draft_seconds, width, verify_seconds)
            if width > 1:
                self.on_widths.append(width - 1)
            self.acceptance.observe(drafted, verdict.num_accepted)
            if self._proposed is not None and self._proposed.confidence is not None:
                kept = set(verdict.path)
                for i, estimate in enumerate(self._proposed.confidence):
                    self.calibration.observe(estimate, i in kept)
                self._proposed = None
            if self.probes.probing:
                plain = self.timings.verify.get(1)
                if plain and self.fixed_costs is None:  # this probe's drafting and forward over a plain step's
                    one = statistics.median(plain)
                    self._probe_cost = max(0.0, (draft_seconds + verify_seconds) / one - 1)
            self.probes.judged(verdict.num_accepted > 0)
        self._verdict_at = time.perf_counter()  # the drafter's own bookkeeping below counts as the step's overhead
        self.inner.accepted(verdict)
