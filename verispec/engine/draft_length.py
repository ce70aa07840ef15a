"""The batched engine's draft length: one k per step for the whole batch, from the batch size and measured costs.

The model of a step is adaptive.py's, per batch size B: drafting k tokens for each of the B sequences yields
sum_i E_i(k) tokens (E_i from sequence i's own acceptance by position, `adaptive.Acceptance`) and costs
k c_B + r_B(k + 1), in units of a target forward of B rows of one token; plain decoding yields B tokens for 1. As the
batch grows, the target's forward stops being bound by reading the weights: r_B(n) climbs towards n and the best k
falls, to 0 (plain decoding) once speculation no longer pays. c_B and r_B come from `adaptive.Timings`, one per batch
size: every step's drafting and verification times, and, the first time a batch size is met, forwards of 1 and
max_k + 1 tokens per row timed on the running batch itself (`measure`), so that r_B has two widths to draw a line
through before the steps have tried them. While plain decoding wins, a one-token probe runs now and then, as in
`AdaptiveK`, so that the acceptance estimates can recover. k is chosen before the step's draws, from past verdicts
and timings only: each step is an ordinary fixed-k step, and the output keeps the target's distribution.
"""

from __future__ import annotations

from typing import Callable, Sequence

from verispec.adaptive import PROBE_BUDGET, PROBE_FIRST, PROBE_MAX, Costs, Timings, expected_tokens

CALIBRATION_REPEATS = 3  # forwards of each width timed when a batch size is first met (their median counts)


class DraftLength:
    """Chooses each step's k in 0..max_k for the batch; `costs(B)` fixes (c, r) per batch size instead of measuring
    them (for tests, or a table measured elsewhere)."""

    def __init__(self, max_k: int, costs: Callable[[int], Costs] | None = None) -> None:
        self.max_k, self.fixed_costs = max_k, costs
        self.timings: dict[int, Timings] = {}
        self._calibrated: set[int] = set()
        self.plain_run, self.probe_every = 0, PROBE_FIRST
        self._probing = self._probe_again = self._drafted_last = False

    def choose(self, rates: Sequence[Sequence[float]], limits: Sequence[int],
               measure: Callable[[int], float | None]) -> int:
        """The k for the next step: `rates` and `limits` per sequence (its acceptance by position, and the most it
        may draft); `measure(n)` times one forward of n tokens per row on the batch (None where it does not fit)."""
        limit = min(self.max_k, max(limits, default=0))
        if limit < 1:
            return 0
        c, r = self.costs(len(rates), measure)
        best, speed = 0, float(len(rates))  # plain decoding: a token per sequence for one forward
        for k in range(1, limit + 1):
            tokens = sum(expected_tokens(a, min(k, n)) for a, n in zip(rates, limits))
            predicted = tokens / (k * c + r(k + 1))
            if predicted > speed * (1 + 1e-9):  # a tie (up to rounding) goes to the cheaper k
                best, speed = k, predicted
        self._probing = False
        if best > 0:
            self.plain_run, self.probe_every, self._probe_again = 0, PROBE_FIRST, False
            return best
        self.plain_run += 1
        wait = 0 if self._probe_again else max(self.probe_every, (c + r(2) - 1) / PROBE_BUDGET)
        if self.plain_run > wait:
            self.plain_run, self._probing = 0, True
            return 1
        return 0

    def costs(self, batch: int, measure: Callable[[int], float | None]) -> Costs:
        """(c, r) at this batch size, timing the target on the batch the first time the size is met."""
        if self.fixed_costs is not None:
            return self.fixed_costs(batch)
        timings = self.timings.setdefault(batch, Timings())
        if batch not in self._calibrated:
            for width in (1, self.max_k + 1) * CALIBRATION_REPEATS:
                seconds = measure(width)
                if seconds is None:  # some row is too near the end of its context: try again at a later step
                    break
                timings.observe(0, 0.0, width, seconds)
            else:
                self._calibrated.add(batch)
        return timings.costs()

    def observe(self, batch: int, drafted: int, draft_seconds: float, width: int, verify_seconds: float,
                accepted: bool) -> None:
        """A step's timings (`drafted` tokens per sequence, a forward `width` tokens wide) and whether any of its
        proposals had a token accepted."""
        # The first drafting step after plain steps also feeds a draft model the tokens it has not seen yet.
        clean = drafted if self._drafted_last else 0
        self._drafted_last = drafted > 0
        self.timings.setdefault(batch, Timings()).observe(clean, draft_seconds, width, verify_seconds)
        if self._probing:
            self._probe_again = accepted
            self.probe_every = PROBE_FIRST if accepted else min(2 * self.probe_every, PROBE_MAX)
