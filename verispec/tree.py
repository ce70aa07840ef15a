"""Token trees: a proposal's tokens laid out for one target forward, and the acceptance walk over them.

Node 0 of the forward is the last committed token (the root); proposal token i is node i + 1. A chain
is the tree whose parents are -1, 0, 1, ...
"""

from __future__ import annotations

import torch

from verispec.errors import DrafterError
from verispec.models.greedy import argmax
from verispec.proposal import Proposal
from verispec.sampling import SamplingParams, logits_to_probs, sample


def chain_parents(n: int) -> list[int]:
    """The parents of n tokens in one chain: -1, 0, 1, ..., n - 2."""
    return list(range(-1, n - 1))


def depths(parents: list[int]) -> list[int]:
    """Depth of each proposal token (children of the root are at depth 1)."""
    out: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"token {i}: parent {parent} must be -1 or an earlier token")
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def depth(proposal: Proposal) -> int:
    """How many tokens deep the proposal reaches: the most that one step can accept."""
    return len(proposal.tokens) if proposal.parents is None else max(depths(proposal.parents), default=0)


def layout(proposal: Proposal, start: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Attention mask (T, T) among the forward's new tokens (root, proposal, side branch) and their positions.

    Each proposal token sees the root, its ancestors and itself; side tokens see the root and what their own
    mask allows. A plain chain needs neither: (None, None) keeps the model's causal fast path.
    """
    if proposal.parents is None and proposal.side is None:
        return None, None
    parents = chain_parents(len(proposal.tokens)) if proposal.parents is None else proposal.parents
    n, side = len(parents), proposal.side
    s = 0 if side is None else len(side.tokens)
    mask = torch.zeros(1 + n + s, 1 + n + s, dtype=torch.bool)
    mask[:, 0] = True
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i + 1, : 1 + n] = mask[parent + 1, : 1 + n]  # the parent's ancestors (parents come first)
        mask[i + 1, i + 1] = True
    offsets = [0, *depths(parents)]
    if side is not None:
        mask[1 + n :, 1 + n :] = side.mask
        offsets += side.offsets
    return mask.to(device), start + torch.tensor(offsets, device=device)


def through_eos(tokens: list[int], eos: frozenset[int]) -> int:
    """How many tokens to keep: up to and including the first end-of-sequence token."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def subset(proposal: Proposal, keep: list[int]) -> Proposal:
    """The proposal's tokens at `keep` (ascending; in a tree each one's parent kept too, in a chain a prefix),
    renumbered, with their q rows and the side branch."""
    if len(keep) == len(proposal.tokens):
        return proposal
    new_index = {old: new for new, old in enumerate(keep)} | {-1: -1}
    parents = None if proposal.parents is None else [new_index[proposal.parents[i]] for i in keep]
    q = None if proposal.q is None else proposal.q[keep]
    confidence = None if proposal.confidence is None else [proposal.confidence[i] for i in keep]
    return Proposal([proposal.tokens[i] for i in keep], q, parents, proposal.side, confidence)


def cut_after_eos(proposal: Proposal, eos: frozenset[int]) -> tuple[Proposal, list[int]]:
    """Drop every token that follows an end-of-sequence token (nothing after it can be kept); also returns
    the original index of each token kept, so that a verdict can be told in the drafter's numbering."""
    if proposal.parents is None:
        keep = list(range(through_eos(proposal.tokens, eos)))
    else:
        keep, kept = [], {-1}
        for i, parent in enumerate(proposal.parents):
            if parent in kept and (parent < 0 or proposal.tokens[parent] not in eos):
                kept.add(i)
                keep.append(i)
    return subset(proposal, keep), keep


def verify_tree(
    proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[list[int], int]:
    """Walk from the root: (indices of the accepted tokens, the target's next token).

    logits (1 + n, V) at the root and at each proposal token. Greedy: follow the child equal to the
    target's argmax. Sampling: SpecInfer's multi-candidate rule, which keeps the target distribution p:
    try the children in order, accepting child x with probability min(1, p(x)/q(x)); after each
    rejection p becomes norm(max(0, p - q)); if no child is accepted, sample from what p has become
    (a leaf's p unchanged: the bonus token). q is the children's shared row of `proposal.q` (they must be independent
    draws from it, with replacement), or one-hot at each child where `proposal.q` is None (distinct fixed candidates).
    """
    parents = proposal.parents if proposal.parents is not None else chain_parents(len(proposal.tokens))
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    path, node = [], -1
    while True:
        row = logits[node + 1]
        if sampling.greedy:
            best = int(argmax(row))
            child = next((c for c in children[node + 1] if proposal.tokens[c] == best), None)
            if child is None:
                return path, best
        else:
            p, child, kids = logits_to_probs(row, sampling), None, children[node + 1]
            if proposal.q is not None and any(not torch.equal(proposal.q[c], proposal.q[kids[0]]) for c in kids):
                raise DrafterError(
                    "sampled siblings must be independent draws from one q (SpecInfer's rule); "
                    "these have different q rows"
                )
            for c in kids:
                x = proposal.tokens[c]
                q = None if proposal.q is None else proposal.q[c].to(p.dtype)
                qx = 1.0 if q is None else float(q[x])
                if float(torch.rand((), generator=generator, device=p.device)) * qx < float(p[x]):
                    child = c
                    break
                residual = p.clone() if q is None else (p - q).clamp_min(0)
                if q is None:
                    residual[x] = 0.0
                mass = residual.sum()
                if mass > 0:  # zero only by round-off when p and q all but coincide
                    p = residual / mass
            if child is None:
                return path, int(sample(p, generator))
        path.append(child)
        node = child
