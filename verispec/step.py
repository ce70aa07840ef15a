"""One speculative step, as in the papers: the target scores a proposal in ONE forward, the rule keeps what it
agrees with and adds its own next token, and the cache is cut back to what was kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.drafters.base import Proposal
from verispec.models.protocol import Cache, CausalLM
from verispec.sampling import SamplingParams
from verispec.tree import layout, verify_tree
from verispec.verify import verify


@dataclass(frozen=True)
class StepResult:
    path: list[int]  # indices of the accepted proposal tokens, root to leaf
    next_token: int  # the target's own token after them: its correction, or the bonus token
    side_logits: torch.Tensor | None  # (S, V) at the side branch's tokens, when the proposal had one
    hidden: torch.Tensor | None  # (1 + len(path), len(layers), D) at the last committed token and the accepted ones


def speculative_step(target: CausalLM, cache: Cache, last: int, proposal: Proposal, sampling: SamplingParams,
                     generator: torch.Generator, hidden: Sequence[int] = ()) -> StepResult:
    """`cache` holds every committed token but `last`. One forward over [last, proposal, side branch] gives the
    target's p at the root and at every proposed token; greedy match, speculative sampling with the draft's q
    (a chain) or SpecInfer's walk (a tree) picks the accepted path and the next token; the cache keeps `last` and
    the accepted path, in order. An empty proposal is one step of plain decoding."""
    start, V = cache.length, target.vocab_size
    side = [] if proposal.side is None else proposal.side.tokens
    mask, positions = layout(proposal, start, target.device)
    x = torch.tensor([[last, *proposal.tokens, *side]], device=target.device)
    if hidden:  # only where asked: it is a capability, and a causal-only model need not take the keyword
        logits, states = target(x, cache, mask, positions, hidden=hidden)
    else:
        logits, states = target(x, cache, mask, positions), None
    p_logits = logits[0, :, :V]  # rows: the root, the proposal's tokens, the side branch
    nodes = 1 + len(proposal.tokens)
    if proposal.parents is None:
        n, next_token = verify(proposal.tokens, proposal.q, p_logits[None, :nodes], sampling, generator)
        path = list(range(n))
    else:
        path, next_token = verify_tree(proposal, p_logits[:nodes], sampling, generator)
    cache.keep(start + 1, path)
    rows = [0, *(1 + i for i in path)]
    return StepResult(path, next_token, p_logits[nodes:] if side else None,
                      None if states is None else states[0, rows])
