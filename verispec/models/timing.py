"""Timing one forward of a model apart from any generation (a stopwatch, not a model of cost): what the bench's cost
model (bench/costs.py), its formats report, the layer-skip search and the heads' model cards measure. The cost model
that chooses k at run time (cost_model.py) times the steps themselves instead."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from verispec.models.forward_options import VocabHead
from verispec.models.linear import matmul_by
from verispec.models.native import NativeModel


def forward_seconds(
    model: NativeModel,
    new_tokens: int,
    context: int = 256,
    repeats: int = 7,
    layers: Sequence[int] | None = None,
    head: VocabHead | None = None,
) -> float:
    """Median time of one forward of `new_tokens` tokens after `context` cached ones (batch 1), running only
    the blocks `layers` (all by default) in the timed forward, and `head` (an LM head over part of the vocabulary)
    in place of the whole one."""
    times = []
    prefix = torch.arange(context, device=model.device)[None] % model.vocab_size
    chunk = torch.arange(new_tokens, device=model.device)[None]
    cache = model.new_cache(context + new_tokens)
    model(prefix, cache)
    for _ in range(repeats):
        start = time.perf_counter()
        model(chunk, cache, layers=layers, head=head)
        times.append(time.perf_counter() - start)
        cache.truncate(context)
    return sorted(times)[len(times) // 2]


def head_step_seconds(
    target: NativeModel, head, vocab: int | None = None, context: int = 256, repeats: int = 7, width: int = 1
) -> float:
    """Median time of one EAGLE drafting step: the head over `width` (feature, token) pairs after `context` cached
    entries (a chain's step is one; an EAGLE-2 tree expands its frontier in one such call), then the target's LM head
    over its `width` predicted features (its first `vocab` rows: a reduced draft vocabulary), or the head's own LM
    head where it has one (EAGLE-3)."""
    feature = torch.zeros(1, width, target.hidden_size, dtype=target.dtype, device=target.device)
    embedding = target.embed(torch.zeros(1, width, dtype=torch.long, device=target.device))
    cache = head.new_cache(context + width, target.dtype, target.device)
    has_own_head = head.own_vocab is not None  # as the drafter runs it
    times, lm_head = [], head.logits if has_own_head else matmul_by(target.lm_head_weight[:vocab].contiguous())
    with torch.inference_mode():
        head(feature[:, :1].expand(1, context, -1), embedding[:, :1].expand(1, context, -1), cache)
        for _ in range(repeats):
            start = time.perf_counter()
            predicted = head(feature, embedding, cache)
            lm_head(predicted)
            times.append(time.perf_counter() - start)
            cache.truncate(context)
    return sorted(times)[len(times) // 2]


def medusa_step_seconds(target: NativeModel, heads, vocab: torch.Tensor | None = None, repeats: int = 7) -> float:
    """Median time of one Medusa drafting step: every head over one feature (with LM heads over the rows `vocab`
    only: a reduced draft vocabulary), then their top-k."""
    feature = torch.zeros(target.hidden_size, dtype=target.dtype, device=target.device)
    times, lm_heads = [], None if vocab is None else heads.lm_head_rows(vocab)
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            heads(feature, lm_heads).topk(4, dim=-1)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
