"""Any transformers causal LM through the same model protocol, for architectures the native runtime lacks.

The cache is transformers' own `DynamicCache`, rolled back with `crop(-n)` (transformers 5.x).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from verispec.errors import CheckpointError, ContextLengthError, InvalidArgumentError
from verispec.models.native import parse_dtype
from verispec.models.protocol import Capabilities
from verispec.tokenizer import as_id_set


class TransformersCache:
    """A `DynamicCache` with the length bookkeeping the loop relies on."""

    def __init__(self, kv, max_len: int) -> None:
        self.kv, self.max_len, self.length = kv, max_len, 0

    def reserve(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ContextLengthError(f"the context holds {self.max_len} positions; {self.length} used, {n} more asked")

    def truncate(self, length: int) -> int:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        removed = self.length - length
        if removed:
            self.kv.crop(-removed)
        self.length = length
        return removed

    def keep(self, start: int, offsets: list[int]) -> None:
        """A chain's accepted prefix only: token trees need tree masks, which this adapter does not take."""
        if offsets != list(range(len(offsets))):
            raise InvalidArgumentError("keeping a token tree's branch needs the native runtime's cache")
        self.truncate(start + len(offsets))


class TransformersModel:
    """`model(tokens, cache) -> logits` over a `transformers` PreTrainedModel and its fast tokenizer.

    A causal chain only: no tree masks, hidden states or layer subsets (drafters that need them refuse it).
    """

    capabilities = Capabilities()

    def __init__(self, model, tokenizer, name: str) -> None:
        self.model, self.name = model.eval(), name
        self.tokenizer = tokenizer.backend_tokenizer  # the `tokenizers.Tokenizer` behind a fast tokenizer
        config = model.config.get_text_config()
        self.eos_token_ids = as_id_set(model.generation_config.eos_token_id) | as_id_set(config.eos_token_id)
        self.vocab_size = min(model.get_output_embeddings().weight.shape[0], len(tokenizer))
        self.context_length = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
        self.hidden_size, self.num_layers = config.hidden_size, config.num_hidden_layers
        self.device = model.device

    def new_cache(self, max_len: int | None = None) -> TransformersCache:
        from transformers import DynamicCache

        return TransformersCache(DynamicCache(config=self.model.config), max_len or self.context_length)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: TransformersCache, mask: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, *, hidden: Sequence[int] | None = None) -> torch.Tensor:
        if mask is not None or positions is not None or hidden is not None:
            raise InvalidArgumentError("token trees (custom masks and positions) and hidden states need the "
                                       "native runtime")
        T = tokens.shape[1]
        cache.reserve(T)
        positions = torch.arange(cache.length, cache.length + T, device=tokens.device)[None]
        logits = self.model(input_ids=tokens, position_ids=positions, cache=cache.kv, use_cache=True).logits
        cache.length += T
        return logits


def load_transformers_model(name_or_path: str | Path, device: str | torch.device = "cpu",
                            dtype: str | torch.dtype = "float32") -> TransformersModel:
    """Load with `AutoModelForCausalLM` and `AutoTokenizer` (a local folder, or a hub id where a network exists)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=parse_dtype(dtype)).to(device)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{name_or_path}: transformers cannot load it ({str(err).splitlines()[0]})") from None
    if not tokenizer.is_fast:
        raise CheckpointError(f"{name_or_path}: needs a fast (tokenizers-backed) tokenizer")
    return TransformersModel(model, tokenizer, Path(str(name_or_path)).name)
