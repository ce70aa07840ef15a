"""The step's cost model at run time: what drafting k tokens yields and costs, estimated from the running generation's
(or batch's) own steps, and when a drafter that plain decoding beats is tried again. `AdaptiveK`
(drafters/adaptive.py) chooses each step's k with it, and the batched engine each batch step's
(engine/draft_length.py, with `CostCurve`, a forward's cost by the tokens it carries, for every batch size).

The other cost model is the bench's (bench/costs.py): it predicts a finished run's speedup from forwards timed apart
beforehand (models/timing.py times them), for the report; nothing here is measured apart from the steps themselves.

Drafting k tokens yields E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens, a_j the acceptance at draft position j given
that the earlier ones were accepted, and costs s + k c + r(w + 1) in units of a one-token target forward (w the
tokens the proposal puts into the forward: k for a chain); k = 0 is a plain step (E = 1, cost = 1).

Estimates, per generation, from this generation's own steps only:
- a_j (`Acceptance`): decayed counts of accepted / tried at position j with a Beta prior (mean: a_{j-1}'s estimate,
  PRIOR_ACCEPTANCE at j = 1; weight PRIOR_WEIGHT), every count multiplied by DECAY at each drafting step, so the
  last ten or so steps count, and a depth left untried drifts back to the estimate of the one before it (and is
  tried again).
- costs (`Timings`): drafting (a line through the fastest recent time of each k drafted: s, where it starts, and c
  per token) and the verification (the target's forward), keeping the median of the last few steps per forward
  width (a median shrugs off a stall on a shared machine; a width's and a draft length's first timing is left out,
  as it may include one-time work such as capturing the forward on verispec's kernels). Widths not yet timed come
  from a line through the timed ones (a prior slope while only one width is known); a wider forward never counts as
  cheaper than one token. The loop's own work per step is timed too and priced into every step, plain or not.
  Online rather than a table measured up front: a CLI generation is one process, and timing nine widths first would
  cost a visible share of it; and these timings are taken under the load the steps themselves run in.
- probes (`Probes`): while k = 0 is best, a probe runs every so many plain steps, so that a drafter that starts
  agreeing later is picked up: first after PROBE_FIRST steps, then twice as long after each probe that had nothing
  accepted, and never more often than keeps the probes' cost under PROBE_BUDGET of the time (but at least every
  PROBE_WAIT_MAX steps, since that cost comes from timings only a probe can renew).

k is chosen from past verdicts and timings only, never from the current step's draws, so the acceptance rule, and
with it the output's distribution, is untouched: a k fixed in advance of the step.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable, Sequence

import numpy as np

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 1.0
DECAY = 0.9
PRIOR_C, PRIOR_SLOPE = 0.1, 0.1  # draft token / target token, and r(n) = 1 + slope (n - 1), until measured
TIMING_WINDOW = 9  # steps whose median timing is kept per width
PROBE_FIRST, PROBE_MAX, PROBE_BUDGET = 4, 64, 0.01
PROBE_WAIT_MAX = 128  # plain steps between probes at most, however costly they look: a probe also re-measures that cost

CALIBRATION_BINS, CALIBRATION_WEIGHT, CALIBRATION_DECAY = 10, 4.0, 0.99

Costs = tuple[
    float, Callable[[int], float]
]  # (c, r): draft token cost and target cost of n tokens, per 1-token forward


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j: tokens a step yields, the target's own included."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def best_k(
    acceptance: Sequence[float],
    c: float,
    r: Callable[[int], float],
    choices: Sequence[int],
    width: Callable[[int], int] = lambda k: k,
    overhead: float = 0.0,
    start: float = 0.0,
) -> int:
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


def best_prefix(chances: Sequence[float], r: Callable[[int], float], overhead: float = 0.0) -> int:
    """How many of a proposal's tokens to verify, given each one's chance of being accepted (in the order drawn, so
    that every prefix is a proposal): the n with the highest predicted speed (1 + sum of the first n chances) /
    (r(n + 1) + overhead), the smaller on a tie; 0 is a plain step. Their drafting is already paid for."""
    best, speed, expected = 0, 1.0 / (1.0 + overhead), 1.0
    for n, chance in enumerate(chances, 1):
        expected += chance
        predicted = expected / (r(n + 1) + overhead)
        if predicted > speed * (1 + 1e-9):
            best, speed = n, predicted
    return best


class Calibration:
    """A drafter's own estimate of a token's chance (`Proposal.confidence`) -> how often such tokens were accepted:
    decayed counts in CALIBRATION_BINS bins of the estimate, each with a prior of CALIBRATION_WEIGHT tokens at the
    estimate itself. Suffix decoding's estimates are counts in the text so far, and a continuation seen once is
    "certain"; what the target then accepts says what such certainty is worth."""

    def __init__(
        self, bins: int = CALIBRATION_BINS, weight: float = CALIBRATION_WEIGHT, decay: float = CALIBRATION_DECAY
    ) -> None:
        self.bins, self.weight, self.decay = bins, weight, decay
        self.tried, self.hits = [0.0] * bins, [0.0] * bins

    def _bin(self, estimate: float) -> int:
        return min(max(int(estimate * self.bins), 0), self.bins - 1)

    def observe(self, estimate: float, accepted: bool) -> None:
        b = self._bin(estimate)
        self.tried[b] = self.decay * self.tried[b] + 1
        self.hits[b] = self.decay * self.hits[b] + accepted

    def chance(self, estimate: float) -> float:
        b = self._bin(estimate)
        return (self.hits[b] + self.weight * estimate) / (self.tried[b] + self.weight)


class Acceptance:
    """a_j, the chance that draft position j is accepted once positions 1..j-1 were: a Beta posterior over decayed
    counts, whose prior mean is the estimate at j - 1, so depths not yet tried look like the deepest one that was."""

    def __init__(
        self, k: int, prior: float = PRIOR_ACCEPTANCE, weight: float = PRIOR_WEIGHT, decay: float = DECAY
    ) -> None:
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
            # A width's first forward may also do one-time work (on verispec's kernels it is captured then, which costs
            # more than a replay: models/captured.py), so it is not its price. Left in, one such timing at a width
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
            ((m, t),) = seen.items()
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
        line = lambda n: seen.get(
            n, min(fit(n), seen[widest] + PRIOR_SLOPE * one * (n - widest)) if n > widest else fit(n)
        )
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


class Probes:
    """When to try drafting again while plain decoding is predicted to be faster (a probe): the schedule that
    `AdaptiveK` and the batched engine share. `now`: probe at the first plain step (nothing is known of the
    drafter yet); `repeat_accepted`: after a probe that had a token accepted, probe again at the next plain step."""

    def __init__(self, now: bool = False, repeat_accepted: bool = False) -> None:
        self.plain_run = 0  # plain steps since the last probe or drafting step
        self.every = PROBE_FIRST  # the least plain steps between probes
        self.probing = False  # the step chosen last is a probe
        self.now, self.repeat_accepted = now, repeat_accepted

    def drafting(self) -> None:
        """Drafting was chosen on its merits: the schedule starts over."""
        self.probing, self.plain_run, self.every, self.now = False, 0, PROBE_FIRST, False

    def plain(self, cost: float) -> tuple[bool, float]:
        """A plain step was predicted best: whether to probe instead, and how many plain steps the schedule waits in
        all. `cost`: what a probe costs over a plain step, in plain steps."""
        self.probing = False
        self.plain_run += 1
        wait = 0 if self.now else min(max(self.every, cost / PROBE_BUDGET), PROBE_WAIT_MAX)
        if self.plain_run > wait:
            self.plain_run, self.probing = 0, True
            self.now = self.now and self.repeat_accepted  # (a first probe is not repeated but by its verdict)
            return True, wait
        return False, wait

    def judged(self, accepted: bool) -> None:
        """The verdict of the step chosen last: a probe that had nothing accepted doubles the wait."""
        if self.probing:
            self.every = PROBE_FIRST if accepted else min(2 * self.every, PROBE_MAX)
            if self.repeat_accepted:
                self.now = accepted


class CostCurve:
    """Median seconds of a forward by its size (the tokens it carries: rows x width, padding included), over the
    last `window` observations at each size. A forward's cost follows the tokens it carries, whatever the rows, so
    one curve prices every batch size and width: a size not seen is read off the piecewise-linear curve through the
    seen ones, flat below the smallest, along the last segment's slope beyond the largest. The medians are made
    non-decreasing first: noise never makes a bigger forward look cheaper."""

    def __init__(self, window: int = TIMING_WINDOW) -> None:
        self.window = window
        self.seen: dict[int, deque[float]] = {}

    def observe(self, size: int, seconds: float) -> None:
        self.seen.setdefault(size, deque(maxlen=self.window)).append(seconds)

    def near(self, size: int) -> bool:
        """Whether a seen size lies within a factor of two of `size` on its side of the curve (at or below it when it
        is below the largest seen; at or above it otherwise), so that reading it off the curve is a short reach."""
        if not self.seen:
            return False
        return min(self.seen) <= 2 * size if size <= max(self.seen) else max(self.seen) * 2 >= size

    def __call__(self, size: int) -> float | None:
        """Seconds of a forward of `size` tokens; None before anything was seen."""
        if not self.seen:
            return None
        sizes = sorted(self.seen)
        times = np.maximum.accumulate([statistics.median(self.seen[s]) for s in sizes])
        if size <= sizes[-1] or len(sizes) == 1:
            return float(np.interp(size, sizes, times))
        slope = max(0.0, (times[-1] - times[-2]) / (sizes[-1] - sizes[-2]))
        return float(times[-1] + slope * (size - sizes[-1]))
