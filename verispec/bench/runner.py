"""Running the methods: one process, a warm-up, methods interleaved prompt by prompt, several repeats."""

from __future__ import annotations

import gc
import random
from dataclasses import asdict

from tqdm import tqdm

from verispec.bench.methods import Runner


def run_suite(
    methods: dict[str, Runner],
    prompts: list[tuple[dict, list[int]]],
    repeats: int = 3,
    progress: bool = True,
    seed: int = 0,
) -> list[dict]:
    """A record per (repeat, prompt, method). The methods run in a fresh seeded random order for each prompt,
    so that drift in the machine's speed, and whatever one run leaves behind for the next, fall on all alike."""
    names, rng = list(methods), random.Random(seed)
    for name in names:  # warm-up: first calls pay for allocation and kernel selection
        methods[name](prompts[0][1], 4)
    # What exists now (models, libraries) lives to the end: frozen, the collections below scan only what the runs
    # make, instead of every object of transformers and torch each time.
    gc.collect()
    gc.freeze()
    records = []
    try:
        bar = tqdm(total=repeats * len(prompts) * len(names), disable=not progress, desc="bench", unit="run")
        for repeat in range(repeats):
            for item, ids in prompts:
                for name in rng.sample(names, len(names)):
                    gc.collect()  # outside the timed call, so no run pays for another's garbage
                    constrained = {"grammar": item["grammar"]} if "grammar" in item else {}  # a JSON suite's schema
                    run = methods[name](ids, item["max_new_tokens"], **constrained)
                    records.append(
                        {
                            "method": name,
                            "id": item["id"],
                            "category": item["category"],
                            "groups": item.get("groups", []),
                            "repeat": repeat,
                            **asdict(run),
                        }
                    )
                    bar.update()
        bar.close()
    finally:
        gc.unfreeze()
    return records
