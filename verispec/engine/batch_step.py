"""One speculative step for a batch: ONE target forward over every sequence's [last, proposal], the acceptance rule
per sequence, and each sequence's cache slot cut back to what it kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.drafters.base import Proposal
from verispec.models.batch_cache import BatchKVCache
from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams
from verispec.verify import verify


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of the step."""

    slot: int  # its cache slot, which holds every committed token but `last`
    last: int
    proposal: Proposal  # a chain, possibly empty (a plain step)
    sampling: SamplingParams
    generator: torch.Generator


def batched_step(target: CausalLM, cache: BatchKVCache, rows: list[SequenceStep]) -> list[tuple[int, int] | Exception]:
    """`speculative_step` for every row at once: returns (accepted proposal tokens, the target's next token) per row,
    or the exception its acceptance rule raised (that row's slot keeps only what it had; the others go on).

    The rows are right-padded to the longest; each is verified on its own logits with its own sampling settings and
    generator (the same rule and the same draws as alone), and its slot keeps `last` and its accepted tokens."""
    counts = [1 + len(row.proposal.tokens) for row in rows]
    x = torch.zeros(len(rows), max(counts), dtype=torch.long, device=target.device)
    for b, row in enumerate(rows):
        x[b, : counts[b]] = torch.tensor([row.last, *row.proposal.tokens], device=target.device)
    starts = [cache.lengths[row.slot] for row in rows]
    logits = target.forward_batch(x, cache, [row.slot for row in rows], counts)
    out = []
    for b, (row, start) in enumerate(zip(rows, starts)):
        try:
            n, token = verify(row.proposal.tokens, row.proposal.q, logits[b: b + 1, : counts[b], : target.vocab_size],
                              row.sampling, row.generator)
        except Exception as err:  # one sequence's fault (its sampling, its drafter's q) is that sequence's alone
            cache.truncate(row.slot, start)
            out.append(err)
            continue
        cache.truncate(row.slot, start + 1 + n)
        out.append((n, token))
    return out
