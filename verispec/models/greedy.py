"""The greedy choice: the argmax of logits, on verispec's kernel where it runs.

Below the sampling layer because a model's own greedy chain (models/execution.py) takes it too, and both must pick
the same token for the same logits."""

from __future__ import annotations

import torch

from verispec import kernels


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1), (..., V) -> (...), by verispec's kernel where it runs (its ties and NaNs go as
    torch's): PyTorch's is scalar in bfloat16, and greedy decoding takes one per token."""
    rows = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])  # (a view less: each step asks)
    if rows.stride(-1) == 1 and kernels.available(logits.dtype, logits.device):
        out = kernels.argmax(rows)
        return out if logits.dim() == 2 else out.view(logits.shape[:-1])
    return logits.argmax(-1)
