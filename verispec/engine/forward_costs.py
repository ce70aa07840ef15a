"""Measured forward costs by size: what the engine prices a step's k with, for every batch size at once."""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

from verispec.cost_model import TIMING_WINDOW


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
