"""The thread count verispec computes with: its kernels' pool (verispec/kernels/pool.cpp) and torch's intra-op threads,
set together; the default, and a way to set it from Python (docs/threads.md).

The kernels split each call over output columns, heads or rows, never over a sum, so every count gives the same bits.
Their pool's threads claim work in chunks rather than each being handed a share, so a thread whose core another
process holds delays a call only by the chunk it is running; they spin a short while between calls, then sleep.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from verispec.errors import InvalidArgumentError
from verispec.kernels import build, cores
from verispec.kernels.cores import MAX_THREADS, physical_cores

__all__ = ["MAX_THREADS", "current_threads", "default_threads", "physical_cores", "set_threads", "torch_threads"]


def default_threads() -> int:
    """$VERISPEC_THREADS, else $OMP_NUM_THREADS (a choice someone made for this machine), else the physical cores
    this process may run on."""
    try:
        return cores.default_threads()
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None


def current_threads() -> int:
    """The count set last (`set_threads`), else the default."""
    return build.requested_threads() or default_threads()


def set_threads(threads: int | None = None) -> int:
    """Set the process's thread count, the kernels' and torch's (None: `default_threads()`); returns the count set."""
    try:
        threads = default_threads() if threads is None else cores.checked(threads)
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None
    torch.set_num_threads(threads)
    build.set_pool_threads(threads)
    return threads


@contextmanager
def torch_threads(threads: int | None = None) -> Iterator[int]:
    """`set_threads` for a block; the previous counts are restored after it."""
    previous, torch_previous = current_threads(), torch.get_num_threads()
    try:
        yield set_threads(threads)
    finally:
        set_threads(previous)
        torch.set_num_threads(torch_previous)
