"""One speculative step, as in the papers: the target scores a proposal in ONE forward, the rule keeps what it
agrees with and adds its own next token, and the cache is cut back to what was kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.constraint import Constraint
from verispec.models.protocol import CausalLM, SequenceCache
from verispec.proposal import Proposal
from verispec.sampling import SamplingParams, constrain
from verispec.tree import layout, verify_tree
from verispec.verify import verify


@dataclass(frozen=True)
class StepResult:
    path: list[int]  # indices of the accepted proposal tokens, root to leaf
    next_token: int  # the target's own token after them: its correction, or the bonus token
    side_logits: torch.Tensor | None  # (S, V) at the side branch's tokens, when the proposal had one
    hidden: torch.Tensor | None  # (1 + len(path), len(layers), D) at the last committed token and the accepted ones


def speculative_step(
    target: CausalLM,
    cache: SequenceCache,
    last: int,
    proposal: Proposal,
    sampling: SamplingParams,
    generator: torch.Generator,
    hidden: Sequence[int] = (),
    grammar: Constraint | None = None,
) -> StepResult:
    """`cache` holds every committed token but `last`. One forward over [last, proposal, side branch] gives the
    target's p at the root and at every proposed token; greedy match, speculative sampling with the draft's q
    (a chain) or SpecInfer's walk (a tree) picks the accepted path and the next token; the cache keeps `last` and
    the accepted path, in order. An empty proposal is one step of plain decoding.

    With a `grammar`, the proposal's tokens it forbids are dropped first (they cost no row), p is masked at every
    verified position (the draft's q was masked when drawn), and the grammar moves to the accepted path and the next
    token, as the cache does. `path` is in the numbering of the proposal as given."""
    kept = None
    if grammar is not None:
        proposal, kept, allowed = grammar.check(proposal)
    start, V = cache.length, target.vocab_size
    side = [] if proposal.side is None else proposal.side.tokens
    mask, positions = layout(proposal, start, target.device)
    x = torch.tensor([[last, *proposal.tokens, *side]], device=target.device)
    if hidden:  # only where asked: it is a capability, and a causal-only model need not take the keyword
        logits, states = target(x, cache, mask, positions, hidden=hidden)
    else:
        logits, states = target(x, cache, mask, positions), None
    nodes = 1 + len(proposal.tokens)
    p_logits = logits[0, :nodes, :V]  # rows: the root and the proposal's tokens
    if grammar is not None:
        p_logits = constrain(p_logits, allowed.to(p_logits.device))
    if proposal.parents is None:
        n, next_token = verify(proposal.tokens, proposal.q, p_logits[None], sampling, generator)
        path = list(range(n))
    else:
        path, next_token = verify_tree(proposal, p_logits, sampling, generator)
    cache.keep(start + 1, path)
    if grammar is not None:  # the matcher rolls back with the cache: to the kept path, then on by the next token
        grammar.commit([*(proposal.tokens[i] for i in path), next_token])
    rows = [0, *(1 + i for i in path)]
    return StepResult(
        path if kept is None else [kept[i] for i in path],
        next_token,
        logits[0, nodes:, :V] if side else None,
        None if states is None else states[0, rows],
    )
