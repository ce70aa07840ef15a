"""Random Llama-family checkpoints with a byte-level tokenizer: for tests and for trying the engine offline."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from verispec.models.checkpoint import save_checkpoint
from verispec.models.config import ModelConfig
from verispec.reference import init_params
from verispec.tokenizer import byte_level_tokenizer

BYTE_VOCAB = 257  # 256 bytes and <|endoftext|>


def tiny_config(**overrides) -> ModelConfig:
    """A small grouped-query Llama over the byte-level vocabulary; any field can be overridden."""
    base = dict(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=256)
    return ModelConfig(**(base | overrides))


def _weights(config: ModelConfig, seed: int) -> dict:
    return {name: value for name, value in init_params(config, seed).items() if name != "config"}


def random_checkpoint(folder: str | Path, config: ModelConfig, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Path:
    """Write a checkpoint folder with `init_params(config, seed)` weights and the byte-level tokenizer."""
    return save_checkpoint(folder, config, _weights(config, seed), byte_level_tokenizer(), dtype)


def random_pair(folder: str | Path, config: ModelConfig, draft_layers: int = 1, seed: int = 0,
                deep_scale: float = 0.2) -> tuple[Path, Path]:
    """A random target and a draft made of its first `draft_layers` layers (same embeddings, norm and head).

    The target's deeper layers write `deep_scale` times less into the residual stream, so they correct the
    shallow ones rather than replace them and the draft agrees with the target often enough to show speculation.
    """
    weights, tokenizer = _weights(config, seed), byte_level_tokenizer()
    deep = {name for name in weights if name.startswith("model.layers.") and int(name.split(".")[2]) >= draft_layers}
    for name in deep:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * deep_scale
    target = save_checkpoint(Path(folder) / "target", config, weights, tokenizer)
    kept = {name: value for name, value in weights.items() if name not in deep}
    draft_config = replace(config, num_hidden_layers=draft_layers)
    return target, save_checkpoint(Path(folder) / "draft", draft_config, kept, tokenizer)
