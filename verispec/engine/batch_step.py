"""One speculative step for a batch: ONE target forward over every sequence's [last, proposal], the acceptance rule
per sequence, and each sequence's cache slot cut back to what it kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.constraint import Constraint
from verispec.drafters.base import Proposal
from verispec.models.batch_cache import BatchKVCache
from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams, constrain
from verispec.verify import verify


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of the step."""

    slot: int  # its cache slot, which holds every committed token but `last`
    last: int
    proposal: Proposal  # a chain, possibly empty (a plain step)
    sampling: SamplingParams
    generator: torch.Generator
    grammar: Constraint | None = None


def batched_step(target: CausalLM, cache: BatchKVCache, rows: list[SequenceStep]) -> list[tuple[int, int] | Exception]:
    """`speculative_step` for every row at once: returns (accepted proposal tokens, the target's next token) per row,
    or the exception its grammar or acceptance rule raised (that row's slot keeps only what it had; the others go on).

    The rows are right-padded to the longest; each is verified on its own logits with its own sampling settings,
    generator and grammar (the same rule and the same draws as alone: the drafts its grammar forbids dropped first, its
    p masked), and its slot keeps `last` and its accepted tokens, as its grammar does."""
    out: list[tuple[int, int] | Exception | None] = [None] * len(rows)
    chains, allowed = {}, {}  # by row: the chain verified (after the grammar's cut), the grammar's mask of its p
    for b, row in enumerate(rows):
        try:
            if row.grammar is None:
                chains[b], allowed[b] = row.proposal, None
            else:
                chains[b], _, allowed[b] = row.grammar.check(row.proposal)
        except Exception as err:  # that sequence's grammar, or its drafter's q
            out[b] = err
    counts = {b: 1 + len(chain.tokens) for b, chain in chains.items()}
    if chains:
        live = list(chains)
        x = torch.zeros(len(live), max(counts.values()), dtype=torch.long, device=target.device)
        for i, b in enumerate(live):
            x[i, : counts[b]] = torch.tensor([rows[b].last, *chains[b].tokens], device=target.device)
        starts = {b: cache.lengths[rows[b].slot] for b in live}
        logits = target.forward_batch(x, cache, [rows[b].slot for b in live], [counts[b] for b in live])
        for i, b in enumerate(live):
            row = rows[b]
            try:
                p_logits = logits[i : i + 1, : counts[b], : target.vocab_size]
                if allowed[b] is not None:
                    p_logits = constrain(p_logits, allowed[b].to(p_logits.device))
                n, token = verify(chains[b].tokens, chains[b].q, p_logits, row.sampling, row.generator)
                if row.grammar is not None:
                    row.grammar.commit([*chains[b].tokens[:n], token])
            except Exception as err:  # one sequence's fault (its sampling, its drafter's q) is that sequence's alone
                cache.truncate(row.slot, starts[b])
                out[b] = err
                continue
            cache.truncate(row.slot, starts[b] + 1 + n)
            out[b] = (n, token)
    return out
