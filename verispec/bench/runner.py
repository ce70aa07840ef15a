"""Running the methods: one process, a warm-up, methods interleaved prompt by prompt, several repeats."""

from __future__ import annotations

from dataclasses import asdict

from tqdm import tqdm

from verispec.bench.methods import Method


def run_suite(methods: dict[str, Method], prompts: list[tuple[dict, list[int]]], repeats: int = 3,
              progress: bool = True) -> list[dict]:
    """A record per (repeat, prompt, method). The order of methods rotates from prompt to prompt, so that
    drift in the machine's speed falls on every method alike."""
    names = list(methods)
    for name in names:  # warm-up: first calls pay for allocation and kernel selection
        methods[name](prompts[0][1], 4)
    records = []
    bar = tqdm(total=repeats * len(prompts) * len(names), disable=not progress, desc="bench", unit="run")
    for repeat in range(repeats):
        for p, (item, ids) in enumerate(prompts):
            shift = (p + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                run = methods[name](ids, item["max_new_tokens"])
                records.append({"method": name, "id": item["id"], "category": item["category"],
                                "repeat": repeat, **asdict(run)})
                bar.update()
    bar.close()
    return records
