"""How many threads the kernels' pool runs: the cores this process may use, and the default count (docs/threads.md).
verispec.threads sets the count for the process; the kernels start at this default where nothing set it."""

from __future__ import annotations

import os
from numbers import Integral
from pathlib import Path

MAX_THREADS = 1024  # as the pool's (pool.cpp)
ENVIRONMENT = ("VERISPEC_THREADS", "OMP_NUM_THREADS")  # ours first: OMP_NUM_THREADS may be set for other programs


def usable_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """The physical cores among `cpus` (default: those this process may run on): hyper-threads of one core count
    once, as the kernels read memory and fill vector units per core. Where the topology cannot be read, the CPUs."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def checked(threads: object) -> int:
    """`threads` as a count, or ValueError."""
    # bool is an Integral, and torch takes True as 1: refuse it with the other non-counts.
    if isinstance(threads, bool) or not isinstance(threads, Integral) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be an integer from 1 to {MAX_THREADS}, got {threads!r}")
    return int(threads)


def default_threads() -> int:
    """$VERISPEC_THREADS, else $OMP_NUM_THREADS (a choice someone made for this machine), else the physical cores
    this process may run on; ValueError for a variable that is not a count."""
    for name in ENVIRONMENT:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return checked(int(value))
            except ValueError:
                raise ValueError(f"${name} must be an integer from 1 to {MAX_THREADS}, got {value!r}") from None
    return physical_cores()
