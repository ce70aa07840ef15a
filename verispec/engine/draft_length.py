"""The batched engine's draft length: one k per step for the whole batch, from the batch size and measured costs.

The model of a step is cost_model.py's, per batch size B: drafting k tokens for each of the B sequences yields
sum_i E_i(k) tokens (E_i from sequence i's own acceptance by position, `cost_model.Acceptance`) and costs
k c_B + r_B(k + 1), in units of a target forward of B rows of one token; plain decoding yields B tokens for 1. As the
batch grows, the target's forward stops being bound by reading the weights: r_B(n) climbs towards n and the best k
falls, to 0 (plain decoding) once speculation no longer pays. r_B(n) = f(B n) / f(B), with f the target's forward
seconds by the tokens it carries (`CostCurve`), and c_B = d(B) / f(B), with d the drafting seconds per drafted token
at batch size B; both from every step's timings and, where the steps have not reached yet (within a factor of two),
forwards of 1 and max_k + 1 tokens per row timed on the running batch itself (`measure`). While plain decoding wins,
a probe at the most promising k runs now and then, as in `AdaptiveK`, so that the acceptance estimates can recover
(and the very first step is one). k is chosen before the step's draws, from past verdicts and timings only: each step
is an ordinary fixed-k step, and the output keeps the target's distribution.
"""

from __future__ import annotations

from typing import Callable, Sequence

from verispec.cost_model import PRIOR_C, PRIOR_SLOPE, CostCurve, Costs, Probes, expected_tokens


class DraftLength:
    """Chooses each step's k in 0..max_k for the batch; `costs(B)` fixes (c, r) per batch size instead of measuring
    them (for tests, or a table measured elsewhere)."""

    def __init__(self, max_k: int, costs: Callable[[int], Costs] | None = None) -> None:
        self.max_k, self.fixed_costs = max_k, costs
        self.forward, self.drafting = CostCurve(), CostCurve()  # by tokens in the forward; per token, by batch size
        # Until the drafter has drafted once, nothing is known of it: the first step tries it. An accepted probe is
        # not repeated at once: one probe already brings a verdict per sequence of the batch.
        self.probes = Probes(now=True)
        self._drafted_last = False

    def choose(
        self, rates: Sequence[Sequence[float]], limits: Sequence[int], measure: Callable[[int], float | None]
    ) -> int:
        """The k for the next step: `rates` and `limits` per sequence (its acceptance by position, and the most it
        may draft); `measure(n)` times one forward of n tokens per row on the batch (None where it does not fit)."""
        limit = min(self.max_k, max(limits, default=0))
        if limit < 1:
            return 0
        c, r = self.costs(len(rates), measure)
        best, speed = 1, 0.0  # the best drafting k; a tie (up to rounding) goes to the cheaper k
        for k in range(1, limit + 1):
            tokens = sum(expected_tokens(a, min(k, n)) for a, n in zip(rates, limits))
            predicted = tokens / (k * c + r(k + 1))
            if predicted > speed * (1 + 1e-9):
                best, speed = k, predicted
        if speed > len(rates) * (1 + 1e-9):  # plain decoding: a token per sequence for one forward
            self.probes.drafting()
            return best
        # The probe drafts the most promising k, not 1: where a forward of two tokens costs nearly as much as one of
        # five (a CPU's kernels switch there), only a deep probe can show that the deeper positions are accepted.
        probe, _ = self.probes.plain(best * c + r(best + 1) - 1)  # what the probe costs over a plain step
        return best if probe else 0

    def costs(self, batch: int, measure: Callable[[int], float | None]) -> Costs:
        """(c, r) at this batch size, timing the target on the batch where the steps have not reached its sizes."""
        if self.fixed_costs is not None:
            return self.fixed_costs(batch)
        for width in (1, self.max_k + 1):
            if not self.forward.near(batch * width):
                seconds = measure(width)  # one forward per width: the steps add more timings as they run
                if seconds is not None:  # None: some row is too near the end of its context; try at a later step
                    self.forward.observe(batch * width, seconds)
        one, drafting = self.forward(batch), self.drafting(batch)
        if not one:  # nothing timed yet (no room for it): a prior
            return PRIOR_C, lambda n: 1.0 + PRIOR_SLOPE * (n - 1)
        c = PRIOR_C if drafting is None else drafting / one
        # never above n: n tokens per row cost no more than n forwards of one (a stalled timing must not price
        # speculation out for good)
        return c, lambda n: min(float(n), max(1.0, self.forward(batch * n) / one))

    def observe(
        self, batch: int, drafted: int, draft_seconds: float, width: int, verify_seconds: float, accepted: bool
    ) -> None:
        """A step's timings (`drafted` tokens per sequence, a forward `width` tokens wide) and whether any of its
        proposals had a token accepted."""
        # The first drafting step after plain steps also feeds a draft model the tokens it has not seen yet.
        clean = drafted if self._drafted_last else 0
        self._drafted_last = drafted > 0
        self.forward.observe(batch * width, verify_seconds)
        if clean:
            self.drafting.observe(batch, draft_seconds / clean)
        self.probes.judged(accepted)
