"""torch's OpenMP threads and verispec's kernels' pool on the same cores: OpenMP's threads spin after each torch op by
default, on the cores the pool is about to use. Imported first by the package, before torch loads OpenMP, this sets
`OMP_WAIT_POLICY=PASSIVE` (they sleep instead) where the environment does not set it already (docs/threads.md)."""

from __future__ import annotations

import os

VARIABLE = "OMP_WAIT_POLICY"
SET_HERE = VARIABLE not in os.environ
os.environ.setdefault(VARIABLE, "PASSIVE")


def child_environment() -> dict[str, str]:
    """The environment for another program (llama.cpp, whose OpenMP threads want their own default): verispec's
    without the wait policy it set for itself."""
    env = dict(os.environ)
    if SET_HERE:
        env.pop(VARIABLE, None)
    return env
