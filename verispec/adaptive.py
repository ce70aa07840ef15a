"""Adaptive draft length (`-k auto`): each step drafts the k that the step model predicts to be fastest.

The model of a step (DESIGN.md, "Measuring"): drafting k tokens yields E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens,
a_j the acceptance at draft position j given that the earlier ones were accepted, and costs s + k c + r(w + 1) in
units of a one-token target forward (w the tokens the proposal puts into the forward: k for a chain). `AdaptiveK` wraps
any drafter; its session picks the k in 0..drafter.k (and the loop's room) that maximises E(k) / cost(k), k = 0 being
a plain step (E = 1, cost = 1), so it drafts only while the predicted speedup is above 1.

Estimates, per generation, from this generation's own steps only:
- a_j: decayed counts of accepted / tried at position j with a Beta prior (mean: a_{j-1}'s estimate, PRIOR_ACCEPTANCE
  at j = 1; weight PRIOR_WEIGHT), every count multiplied by DECAY at each drafting step, so the last ten or so steps
  count, and a depth left untried drifts back to the estimate of the one before it (and is tried again).
- costs: the session times the drafter's `propose` (a line through the fastest recent time of each k drafted: s,
  where it starts, and c per token) and the verification (from the proposal's return to the verdict, which is the
  target's forward), keeping the median of the last few steps per forward width (a median shrugs off a stall on a shared
  machine; a width's and a draft length's first timing is left out, as it may include one-time work such as capturing
  the forward on verispec's kernels). Widths not yet timed come from a line through the timed ones (a prior slope
  while only one width is known); a wider forward never counts as cheaper than one token.
  The loop's own work per step (from a verdict to the next proposal: commit, stops, text, the drafter's bookkeeping)
  is timed too, as a median, and priced into every step, plain or not: a step that yields more tokens spreads it.
  Online rather than a table measured up front: a CLI generation is one process, and timing nine widths first would
  cost a visible share of it; and these timings are taken under the load the steps themselves run in.
- While k = 0 is best, a probe (k = 1; a tree or window drafter's full size) runs every so many plain steps, so a
  drafter that starts agreeing later is picked up: first after PROBE_FIRST steps, then twice as long after each probe
  that had nothing accepted, and never more often than keeps the probes' cost under PROBE_BUDGET of the time (but at
  least every PROBE_WAIT_MAX steps, since that cost comes from timings only a probe can renew). A probe's cost is the
  larger of its predicted one and what the last probe measured: a draft model first reads every token decoded since
  it last drafted, which the per-step prices leave out;
  after an accepted probe, the next step probes again, until the estimate says drafting pays or a probe fails.
- The drafting time of the first drafting step, and of the first after plain steps, is not taken as a price: a draft
  model then also reads the tokens it has not seen (the whole prompt, at first).

Proposals that are not plain chains (token trees, lookahead's window) keep their configured size: for them `auto`
chooses between that size and 0, priced at the median width of their recent proposals. k is chosen from past verdicts and timings only, never from the current step's
draws, so the acceptance rule, and with it the output's distribution, is untouched: a k fixed in advance of the step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable, Sequence

from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal, Verdict
from verispec.drafters.batch import BatchDraftSession
from verispec.models.protocol import CausalLM
from verispec.tree import depth

AUTO_MAX_K = 8  # the most an `auto` chain drafts per step when built from a method record
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 1.0
DECAY = 0.9
PRIOR_C, PRIOR_SLOPE = 0.1, 0.1  # draft token / target token, and r(n) = 1 + slope (n - 1), until measured
TIMING_WINDOW = 9  # steps whose median timing is kept per width
PROBE_FIRST, PROBE_MAX, PROBE_BUDGET = 4, 64, 0.01
PROBE_WAIT_MAX = 128  # plain steps between probes at most, however costly they look: a probe also re-measures that cost

Costs = tuple[float, Callable[[int], float]]  # (c, r): draft token cost and target cost of n tokens, per 1-token forward


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j: tokens a step yields, the target's own included."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def best_k(acceptance: Sequence[float], c: float, r: Callable[[int], float], choices: Sequence[int],
           width: Callable[[int], int] = lambda k: k, overhead: float = 0.0, start: float = 0.0) -> int:
    """The k in `choices` with the highest predicted speed E(k) / (start + k c + r(width(k) + 1) + overhead), the
    smaller on a tie; k = 0 is a plain step (speed 1 / (1 + overhead)). `overhead` is what every step costs besides
    drafting and the target's forward (the loop's own work), so it favours steps that yield more tokens; `start` is
    what drafting costs whatever k (a draft model's first forward, which also reads the tokens it has not seen)."""
    best, speed = 0, 1.0 / (1.0 + overhead)
    for k in sorted(choices):
        if k > 0:
            predicted = expected_tokens(acceptance, k) / (start + k * c + r(width(k) + 1) + overhead)
            if predicted > speed * (1 + 1e-9):  # a tie (up to rounding) goes to the cheaper k
                best, speed = k, predicted
    return best


class Acceptance:
    """a_j, the chance that draft position j is accepted once positions 1..j-1 were: a Beta posterior over decayed
    counts, whose prior mean is the estimate at j - 1, so depths not yet tried look like the deepest one that was."""

    def __init__(self, k: int, prior: float = PRIOR_ACCEPTANCE, weight: float = PRIOR_WEIGHT,
                 decay: float = DECAY) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        self.tried, self.hits = [0.0] * k, [0.0] * k

    def observe(self, drafted: int, accepted: int) -> None:
        """A step drafted `drafted` deep and `accepted` of them were kept: positions 1..accepted + 1 were tried.

        Every position's counts fade at each drafting step, tried or not: a depth that failed once and was then left
        untried would otherwise keep its one failure for ever, and never be tried again."""
        if drafted == 0:
            return
        for j in range(len(self.tried)):
            tried = j < min(drafted, accepted + 1)
            self.tried[j] = self.decay * self.tried[j] + tried
            self.hits[j] = self.decay * self.hits[j] + (tried and j < accepted)

    def rates(self) -> list[float]:
        out, mean = [], self.prior
        for tried, hits in zip(self.tried, self.hits):
            mean = (hits + self.weight * mean) / (tried + self.weight)
            out.append(mean)
        return out


class Timings:
    """This generation's measured costs: median seconds of the target's forward per width, and the fastest of
    drafting per draft length (a line through them: a start and a cost per token)."""

    def __init__(self, window: int = TIMING_WINDOW) -> None:
        self.window = window
        self.verify: dict[int, deque[float]] = {}
        self.draft: dict[int, deque[float]] = {}  # seconds of drafting k tokens, by k
        self.between: deque[float] = deque(maxlen=window)  # seconds from a verdict to the next proposal
        self.warm: set[int] = set()  # widths whose first forward has run
        self.warm_draft: set[int] = set()  # draft lengths drafted once

    def observe(self, drafted: int, draft_seconds: float, width: int, verify_seconds: float) -> None:
        if width not in self.warm:
            # A width's first forward may also do one-time work (on verispec's kernels it is captured then, at about
            # three replays' cost: models/captured.py), so it is not its price. Left in, one such timing at a width
            # drafted once steepens the line through the widths and can price drafting out for the generation.
            self.warm.add(width)
        else:
            self.verify.setdefault(width, deque(maxlen=self.window)).append(verify_seconds)
        if drafted in self.warm_draft:  # each length's first drafting is left out too, for the same reason
            self.draft.setdefault(drafted, deque(maxlen=self.window)).append(draft_seconds)
        elif drafted:
            self.warm_draft.add(drafted)

    def drafting(self) -> tuple[float, float] | None:
        """Seconds that drafting k tokens takes, as (start, per_token): a line through the fastest recent timing of
        each k with two timings or more, its first left out (a draft model's is mostly its first forward and the
        call around its chain); None before any. With one such k, all of it is taken as the start: a guess that
        drafts longer, which the next k's timings correct, where all of it per token would price every longer k out
        and never learn otherwise. The fastest, not the median: a timing may include one-time work (a draft model
        captures a forward the first time its shape runs, a few forwards' cost, for one or two unseen tokens apart),
        which no more than a stall tells what the next drafting costs."""
        seen = {k: min(times) for k, times in self.draft.items() if len(times) >= 2}
        if len(seen) < 2:
            return (next(iter(seen.values())), 0.0) if seen else None
        k_mean, t_mean, per_token = _line(seen)
        start = min(max(0.0, t_mean - per_token * k_mean), min(seen.values()))  # never more than the cheapest's all
        return start, per_token

    def overhead(self) -> float:
        """The loop's own work per step (from a verdict to the next proposal), per one-token target forward."""
        one = self.verify.get(1)
        if not self.between or not one:
            return 0.0
        return statistics.median(self.between) / statistics.median(one)

    def costs(self) -> tuple[float, Callable[[int], float], float]:
        """(c, r, s) per one-token target forward: drafting's cost per token, the target's of n tokens, and
        drafting's start (`drafting`)."""
        seen = {n: statistics.median(times) for n, times in self.verify.items()}
        if not seen:
            return PRIOR_C, lambda n: 1.0 + PRIOR_SLOPE * (n - 1), 0.0
        if len(seen) == 1:
            (m, t), = seen.items()
            one = t / (1 + PRIOR_SLOPE * (m - 1))
            slope = PRIOR_SLOPE * one
            fit = lambda n: one + slope * (n - 1)
        else:  # least squares through the seen widths' medians
            n_mean, t_mean, slope = _line(seen)
            # Unseen, a plain step costs what the cheapest width seen costs (no forward of more tokens costs less),
            # not the line's value at 1: on a CPU in bfloat16 a forward's cost is flat up to a few rows, then steps
            # up (the matmul's second pass over its rows), and a line through both dives below the flat part.
            one = seen.get(1, min(seen.values()))
            fit = lambda n: max(one, t_mean + slope * (n - n_mean))
        # Past the widest forward seen, never steeper than the prior slope from it: a line through one costly narrow
        # width (float32's 2-token forward takes another kernel) would otherwise price every wider step out unseen,
        # and a step never tried is never measured.
        widest = max(seen)
        line = lambda n: seen.get(n, min(fit(n), seen[widest] + PRIOR_SLOPE * one * (n - widest))
                                  if n > widest else fit(n))
        start, per_token = self.drafting() or (0.0, PRIOR_C * one)
        c = per_token / one
        # Verifying n tokens never costs more than n one-token forwards: a stalled timing must not price speculation
        # out for good (plain steps measure nothing that could correct it).
        return c, lambda n: min(float(n), max(1.0, line(n) / one)), start / one


def _line(points: dict[int, float]) -> tuple[float, float, float]:
    """The least-squares line through two or more points x -> y: the means of x and y and the slope, never below 0
    (a cost does not fall as more tokens are drafted or verified)."""
    xs, ys = list(points), list(points.values())
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    return x_mean, y_mean, max(0.0, slope)


class AdaptiveK:
    """`drafter` with its draft length chosen per step (see the module's notes); `drafter.k` is the most it drafts.

    `costs` fixes (c, r), or (c, r, s) with drafting's start, instead of measuring them (for tests, or a table
    measured elsewhere)."""

    def __init__(self, drafter: Drafter, costs: Costs | tuple[float, Callable[[int], float], float] | None = None
                 ) -> None:
        self.drafter, self.fixed_costs = drafter, costs
        self.name, self.k, self.width, self.needs = drafter.name, drafter.k, drafter.width, drafter.needs
        self.batched = getattr(drafter, "batched", False)  # the engine chooses k itself and drafts with `drafter`
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
        self.fixed_costs = adaptive.fixed_costs
        self.acceptance, self.timings = Acceptance(adaptive.k), Timings()
        self.chosen: list[int] = []  # k asked of the drafter at each step
        self.plain_run, self.probe_every, self._probing = 0, PROBE_FIRST, False
        self._next_probe: int | None = None  # while plain decoding pays, the plain_run of the next judgement
        self.on_widths: deque[int] = deque(maxlen=TIMING_WINDOW)  # tokens a tree or window drafter put in the forward
        self._pending: tuple[int, float, int, float] | None = None  # (drafted, draft seconds, width, when proposed)
        self._drafted_last = False  # whether the previous step drafted: if not, this one's drafting includes a catch-up
        self._probe_again = False  # the last probe was accepted: probe again at once while plain decoding still wins
        self._probe_cost = 0.0  # what the last probe cost over a plain step, in plain steps (catching up included)
        self._verdict_at: float | None = None  # when the last verdict reached this session

    def choose(self, limit: int) -> int:
        """The k for the next step, at most `limit`."""
        if limit < 1:
            return 0
        if self._next_probe is not None and self.plain_run + 1 < self._next_probe:
            self.plain_run += 1  # plain steps leave the acceptance as it was: the choice stands until the probe
            return 0
        if not self.chain and not self.timings.verify and self.fixed_costs is None:
            return limit  # a tree or window drafter: measure its configured size once before judging it
        c, r, start = (*self.fixed_costs, 0.0)[:3] if self.fixed_costs else self.timings.costs()
        choices = range(limit + 1) if self.chain else (0, limit)
        on = round(statistics.median(self.on_widths)) if self.on_widths else self.width  # a tree's usual size
        width = (lambda k: k) if self.chain else (lambda k: on if k else 0)
        overhead = 0.0 if self.fixed_costs else self.timings.overhead()
        k = best_k(self.acceptance.rates(), c, r, choices, width, overhead, start)
        self._probing, self._next_probe = False, None
        if k > 0:
            self.plain_run, self.probe_every, self._probe_again = 0, PROBE_FIRST, False
            return k
        self.plain_run += 1
        probe = 1 if self.chain else limit
        cost = max(start + probe * c + r(width(probe) + 1) - 1, self._probe_cost)  # over a plain step
        wait = 0 if self._probe_again else min(max(self.probe_every, cost / PROBE_BUDGET), PROBE_WAIT_MAX)
        if self.plain_run > wait:
            self.plain_run, self._probing = 0, True
            return probe
        self._next_probe = int(wait) + 1  # the plain_run at which to judge (and probe) again
        return 0

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if self._verdict_at is not None:
            self.timings.between.append(time.perf_counter() - self._verdict_at)
        k = self.choose(k)
        self.chosen.append(k)
        start = time.perf_counter()
        proposal = self.inner.propose(context, k)
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
            if self._probing:
                self._probe_again = verdict.num_accepted > 0
                self.probe_every = PROBE_FIRST if verdict.num_accepted else min(2 * self.probe_every, PROBE_MAX)
                plain = self.timings.verify.get(1)
                if plain and self.fixed_costs is None:  # this probe's drafting and forward over a plain step's
                    one = statistics.median(plain)
                    self._probe_cost = max(0.0, (draft_seconds + verify_seconds) / one - 1)
        self._verdict_at = time.perf_counter()  # the drafter's own bookkeeping below counts as the step's overhead
        self.inner.accepted(verdict)
