"""Acceptance rules: given k drafted tokens and the target's k+1 predictions, keep a prefix and add one token.

Both rules return (num_accepted (B,), next_token (B,)): the target's correction at the first
rejected position, or its bonus token after the last draft when all k were accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.models.greedy import argmax
from verispec.sampling import SamplingParams, logits_to_probs, sample


def greedy_match(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Exact match with the target's argmax: output token-identical to greedy decoding of the target.

    draft: k token ids; target_logits (k+1, V). Lists rather than tensors past the argmax: a handful of tensor ops
    fewer every step.
    """
    choice = argmax(target_logits).tolist()  # (k+1,)
    n = next((i for i, (x, c) in enumerate(zip(draft, choice)) if x != c), len(draft))  # the agreeing prefix
    return n, choice[n]


def speculative_sampling(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. 2023 / Chen et al. 2023: every output token is distributed exactly as under p.

    draft (B, k) tokens drawn from q (B, k, V); p (B, k+1, V) the target's probabilities.
    Accept x with probability min(1, p(x)/q(x)); at the first rejection sample norm(max(0, p - q));
    when all are accepted, the bonus token comes from p (the same formula with q = 0).
    """
    B, k = draft.shape
    px = p[:, :k].gather(-1, draft[..., None])[..., 0]  # (B, k)
    qx = q.gather(-1, draft[..., None])[..., 0]
    r = torch.rand(px.shape, generator=generator, dtype=px.dtype, device=px.device)
    accepted = r * qx < px  # r < p(x)/q(x) without dividing; q(x) > 0 because x was drawn from q
    num_accepted = accepted.int().cumprod(1).sum(1)  # (B,)
    q_then_zero = torch.cat((q, torch.zeros_like(p[:, :1])), dim=1)  # (B, k+1, V)
    rows = torch.arange(B, device=p.device)
    p_n, residual = p[rows, num_accepted], (p - q_then_zero).clamp_min(0)[rows, num_accepted]  # (B, V)
    mass = residual.sum(-1, keepdim=True)
    # A rejection implies p(x) < q(x), so p exceeds q somewhere and the residual has mass; the guard
    # only catches float round-off when p and q are all but equal.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_n)
    return num_accepted, sample(residual, generator)


def one_hot_probs(draft: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q for a drafter that proposes tokens without probabilities: all its mass on the proposed token."""
    return F.one_hot(draft, vocab_size).to(dtype)


def verify(
    draft: list[int],
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator,
) -> tuple[int, int]:
    """One sequence: greedy exact match, or speculative sampling with q (k, V) (one-hot when None)."""
    if sampling.greedy:
        return greedy_match(draft, target_logits[0])
    d = torch.tensor([draft], dtype=torch.long, device=target_logits.device)  # (1, k)
    q = one_hot_probs(d, target_logits.shape[-1]) if q is None else q[None].to(torch.float32)
    n, token = speculative_sampling(d, q, logits_to_probs(target_logits, sampling), generator)
    return int(n), int(token)
