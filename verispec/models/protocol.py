"""What the generation loop needs of a model and of its cache; native and adapted models both provide it."""

from __future__ import annotations

from typing import Protocol

import torch
from tokenizers import Tokenizer


class Cache(Protocol):
    length: int
    max_len: int

    def truncate(self, length: int) -> int:
        """Roll back to `length` positions; returns how many were removed."""

    # Token trees also need `keep(start, offsets)` (move a verified branch into place); the native
    # runtime's KVCache has it, and only it takes tree masks.


class CausalLM(Protocol):
    name: str
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]  # generation stops at any of them
    vocab_size: int  # real vocabulary: logits past it (embedding padding) are never used
    context_length: int
    device: torch.device

    def new_cache(self, max_len: int | None = None) -> Cache:
        """An empty cache for one sequence, `max_len` defaulting to the context length."""

    def __call__(self, tokens: torch.Tensor, cache: Cache, mask: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (1, T, vocab) for T new tokens (1, T) after what the cache holds; the cache grows by T.

        `mask` (T, T) and `positions` (T,) lay out a token tree; by default the tokens form a chain.
        """
