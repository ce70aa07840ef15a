"""torch's intra-op thread count: the default verispec uses, and a way to set it from Python.

torch starts one thread per core. At batch one the forward is a chain of small ops, each ending at a barrier
where every thread waits for the slowest; when another process holds one of the cores, the thread that shares it
runs only in time slices and every barrier waits for its turn: on a 2-core machine with one core busy, two threads
ran the shipped pair many times slower than one (README, "Threads", has the numbers). Leaving one core free keeps a
single busy neighbour from stalling the barriers; on 2 cores that is one thread, which was no slower at its best
than two at theirs.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from numbers import Integral
from typing import Iterator

import torch

from verispec.errors import InvalidArgumentError

ENV_VAR = "VERISPEC_THREADS"


def default_threads() -> int:
    """$VERISPEC_THREADS, else $OMP_NUM_THREADS (a choice someone made for this machine), else the cores this
    process may run on, less one, and at least one."""
    for name in (ENV_VAR, "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return _checked(int(value))
            except (ValueError, InvalidArgumentError):
                raise InvalidArgumentError(f"${name} must be an integer >= 1, got {value!r}") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op thread count for the process (None: `default_threads()`); returns the count set."""
    threads = default_threads() if threads is None else _checked(threads)
    torch.set_num_threads(threads)
    return threads


@contextmanager
def torch_threads(threads: int | None = None) -> Iterator[int]:
    """`set_threads` for a block; the previous count is restored after it."""
    previous = torch.get_num_threads()
    try:
        yield set_threads(threads)
    finally:
        torch.set_num_threads(previous)


def _checked(threads: int) -> int:
    # bool is an Integral, and torch takes True as 1: refuse it with the other non-counts.
    if isinstance(threads, bool) or not isinstance(threads, Integral) or threads < 1:
        raise InvalidArgumentError(f"threads must be an integer >= 1, got {threads!r}")
    return int(threads)
