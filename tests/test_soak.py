"""A soak: hundreds of short generations of every kind, some abandoned mid-stream, with flat memory."""

from __future__ import annotations

import gc
import os

import pytest

from verispec import generate, stream
from verispec.drafters.registry import Method, Resources, build_drafter

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]
METHODS = [
    Method("autoregressive"),
    Method("draft", 3),
    Method("draft", 3, {"branch": 2}),
    Method("ngram", 3),
    Method("layerskip", 2, {"skip": [1]}),
    Method("lookahead", None, {"window": 2, "ngram": 3, "candidates": 2}),
    Method("suffix", 3, {"tree_tokens": 4, "history_tokens": 64}),
]  # its history rotating all the while

pytestmark = pytest.mark.usefixtures("single_thread")


def resident_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(target, drafters, rounds: int) -> None:
    for i in range(rounds):
        for j, drafter in enumerate(drafters):
            options = dict(max_new_tokens=8, ignore_eos=True, temperature=(i + j) % 2 * 0.8, seed=i)
            if (i + j) % 5 == 0:  # abandoned after two pieces
                steps = stream(target, PROMPT[: 3 + i % 7], drafter, **options)
                for _ in zip(steps, range(2)):
                    pass
                steps.close()
            else:
                generate(target, PROMPT[: 3 + i % 7], drafter, **options)


def test_memory_stays_flat_over_hundreds_of_generations(target, draft) -> None:
    drafters = [build_drafter(method, Resources(draft=draft, target=target)) for method in METHODS]
    run(target, drafters, 10)  # warm-up: allocator pools, first-call kernel caches
    gc.collect()
    before = resident_mb()
    run(target, drafters, 50)  # 300 generations
    gc.collect()
    growth = resident_mb() - before
    assert growth < 4.0, f"resident memory grew {growth:.1f} MB over 300 generations"
