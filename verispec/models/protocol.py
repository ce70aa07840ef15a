"""What the generation loop needs of a model and of its cache; native and adapted models both provide it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from tokenizers import Tokenizer

FINAL = -1  # in `hidden`: the final-normed state that the LM head reads (Medusa's and EAGLE-1/2's feature)


@dataclass(frozen=True)
class Capabilities:
    """What a model's forward can do beyond a causal chain of new tokens; drafters declare what they need of it."""

    tree_masks: bool = False  # custom attention masks and rotary positions (token trees, side branches)
    # `hidden=` returns the residual stream after chosen blocks, or FINAL; `embed(tokens)` and `lm_head_weight` reach
    # the two ends of the model, which feature-level drafters (EAGLE, Medusa) share
    hidden_states: bool = False
    layer_subsets: bool = False  # `layers=` runs only some blocks (self-speculative layer skip)
    # `new_batch_cache(slots, max_len)` and `forward_batch(tokens, cache, slots, counts, logits=)`: several
    # sequences, each in its own cache slot with its own length, in one forward (the batched engine)
    batching: bool = False
    # `greedy_chain(tokens, cache, n, among)`: n tokens of greedy decoding in one call (a draft model's chain), the
    # model's own way; a model without it is driven a forward at a time
    greedy_chains: bool = False
    # `vocab_head(ids)`: an LM head over some tokens only (a reduced draft vocabulary), which a forward (`head=`),
    # `forward_batch` and `greedy_chain` (`among`) then run in place of the whole one: logits over those tokens
    vocab_heads: bool = False
    # its weights are a `LlamaForCausalLM` (`module`) that `models.twin.quantized_twin` can make a quantized twin of,
    # a second model that drafts for it (self-speculation)
    twins: bool = False


class SequenceCache(Protocol):
    """One sequence's cache as the generation loop drives it (a native `KVCache`, an adapted model's cache): a length
    that rolls back after each verdict. Where a forward stores its keys and values is `models/llama.py`'s `Cache`."""

    length: int
    max_len: int

    def truncate(self, length: int) -> int:
        """Roll back to `length` positions; returns how many were removed."""

    def keep(self, start: int, offsets: list[int]) -> None:
        """Move the entries at start + offsets[j] to start + j and truncate after them (a verified branch of a
        token tree); a chain's accepted prefix (offsets 0, 1, ..., n - 1) is a plain truncate."""


class CausalLM(Protocol):
    name: str
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]  # generation stops at any of them
    vocab_size: int  # real vocabulary: logits past it (embedding padding) are never used
    context_length: int
    hidden_size: int
    num_layers: int
    capabilities: Capabilities
    device: torch.device

    def new_cache(self, max_len: int | None = None) -> SequenceCache:
        """An empty cache for one sequence, `max_len` defaulting to the context length."""

    def __call__(
        self,
        tokens: torch.Tensor,
        cache: SequenceCache,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        *,
        hidden: Sequence[int] | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (1, T, vocab) for T new tokens (1, T) after what the cache holds; the cache grows by T. With
        `logits_to_keep` n > 0 (as in transformers), the logits of the last n tokens only (1, n, vocab).

        `mask` (T, T) and `positions` (T,) lay out a token tree (`capabilities.tree_masks`); by default the tokens
        form a chain. With `hidden` (`capabilities.hidden_states`; block indices, or FINAL) the call returns
        (logits, hidden states (1, T, len(hidden), hidden_size)) instead.
        """
