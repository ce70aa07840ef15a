"""Any transformers causal LM through the same model protocol, for architectures the native runtime lacks.

The cache is transformers' own `DynamicCache`, rolled back with `crop(-n)` (transformers 5.x).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch

from verispec.checkpoints.folder import check_finite, check_folder
from verispec.checkpoints.gguf_checkpoint import ROPE_FREQS
from verispec.checkpoints.gguf_file import GGUFFile, is_gguf
from verispec.checkpoints.tokenizer import as_id_set, check_tokenizer_fits
from verispec.errors import CheckpointError, ContextLengthError, InvalidArgumentError
from verispec.models.device import usable_device
from verispec.models.precision import DEFAULT_DTYPE, parse_dtype
from verispec.models.protocol import Capabilities


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
    def __call__(
        self,
        tokens: torch.Tensor,
        cache: TransformersCache,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        *,
        hidden: Sequence[int] | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        if mask is not None or positions is not None or hidden is not None:
            raise InvalidArgumentError(
                "token trees (custom masks and positions) and hidden states need the native runtime"
            )
        T = tokens.shape[1]
        cache.reserve(T)
        positions = torch.arange(cache.length, cache.length + T, device=tokens.device)[None]
        logits = self.model(
            input_ids=tokens, position_ids=positions, cache=cache.kv, use_cache=True, logits_to_keep=logits_to_keep
        ).logits
        cache.length += T
        return logits


def transformers_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """What `dtype` means on transformers: auto (precision.DEFAULT_DTYPE) is float32, since transformers' bfloat16
    runs on none of verispec's kernels; any other dtype as asked."""
    return "float32" if dtype == "auto" else dtype


def load_transformers_model(
    name_or_path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = DEFAULT_DTYPE
) -> TransformersModel:
    """Load with `AutoModelForCausalLM` and `AutoTokenizer` (a local folder or GGUF file, or a hub id where a network
    exists), in `transformers_dtype(dtype)` (auto, the default as everywhere, is float32).

    Refuses what transformers would run anyway: weights missing (it fills them at random), unexpected or of the
    wrong shape (the config describes another model), NaN or inf, a tokenizer larger than the model's vocabulary.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype, device = parse_dtype(transformers_dtype(dtype)), usable_device(device)
    if is_gguf(name_or_path):  # opened here first, so that a missing or broken file is named as such
        if ROPE_FREQS in GGUFFile(name_or_path).tensors:
            raise CheckpointError(
                f"{name_or_path}: transformers' GGUF loader leaves out its RoPE frequency factors "
                f"({ROPE_FREQS}, Llama 3.1's RoPE scaling) and would run another model; the native "
                "backend runs it"
            )
    elif os.path.lexists(name_or_path):  # a local folder, not a hub id
        check_folder(name_or_path)
    source = pretrained_source(name_or_path)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(**source)
            # Mismatched shapes come back in the loading info like missing keys, instead of as a RuntimeError
            # that points at a report the quiet logger dropped.
            model, info = AutoModelForCausalLM.from_pretrained(
                **source, dtype=torch_dtype, output_loading_info=True, ignore_mismatched_sizes=True
            )
    except Exception as err:  # transformers' loaders raise anything from OSError to ZeroDivisionError on a bad folder
        reason = (str(err).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{name_or_path}: transformers cannot load it ({type(err).__name__}: {reason})") from None
    _check_loading_info(info, name_or_path, type(model).__name__)
    check_finite(model.named_parameters(), name_or_path)
    if not tokenizer.is_fast:
        raise CheckpointError(f"{name_or_path}: needs a fast (tokenizers-backed) tokenizer")
    check_tokenizer_fits(len(tokenizer), model.get_output_embeddings().weight.shape[0], name_or_path)
    return TransformersModel(model.to(device), tokenizer, Path(str(name_or_path)).name)


def pretrained_source(name_or_path: str | Path) -> dict[str, str]:
    """`from_pretrained`'s arguments for a folder or hub id, or for a GGUF file (which transformers reads from its
    folder, dequantized)."""
    if is_gguf(name_or_path):
        return {"pretrained_model_name_or_path": str(Path(name_or_path).parent), "gguf_file": Path(name_or_path).name}
    return {"pretrained_model_name_or_path": str(name_or_path)}


def _check_loading_info(info: dict, name: str | Path, model_class: str) -> None:
    """transformers loads a checkpoint that does not fit the config and only logs it; here it is an error."""
    problems = [
        f"{len(keys)} {what} ({', '.join(sorted(keys)[:3])}{', ...' if len(keys) > 3 else ''})"
        for what, keys in (("missing", info["missing_keys"]), ("unexpected", info["unexpected_keys"]))
        if keys
    ]
    problems += [
        f"{key} has shape {tuple(found)}, {model_class} expects {tuple(expected)}"
        for key, found, expected in sorted(info["mismatched_keys"])[:3]
    ]
    if problems:
        raise CheckpointError(f"{name}: the weights do not fit the config's {model_class}: {'; '.join(problems)}")


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bar or load report on stderr: what would matter in the report becomes a CheckpointError."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
