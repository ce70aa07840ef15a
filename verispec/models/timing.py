"""Timing one forward of a model: what the benchmark's cost model and the layer-skip search measure."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from verispec.models.native import NativeModel


def forward_seconds(model: NativeModel, new_tokens: int, context: int = 256, repeats: int = 7,
                    layers: Sequence[int] | None = None) -> float:
    """Median time of one forward of `new_tokens` tokens after `context` cached ones (batch 1), running only
    the blocks `layers` (all by default) in the timed forward."""
    times = []
    prefix = torch.arange(context, device=model.device)[None] % model.vocab_size
    chunk = torch.arange(new_tokens, device=model.device)[None]
    cache = model.new_cache(context + new_tokens)
    model(prefix, cache)
    for _ in range(repeats):
        start = time.perf_counter()
        model(chunk, cache, layers=layers)
        times.append(time.perf_counter() - start)
        cache.truncate(context)
    return sorted(times)[len(times) // 2]
