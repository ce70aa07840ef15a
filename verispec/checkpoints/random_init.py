"""Random Llama-family checkpoints with a byte-level tokenizer: for tests and for trying the engine offline."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.folder import param_shapes, save_checkpoint
from verispec.checkpoints.tokenizer import byte_level_tokenizer

BYTE_VOCAB = 257  # 256 bytes and <|endoftext|>


# A small grouped-query Llama's shapes over the byte-level vocabulary (the tests' transformers configs take them too)
TINY_SHAPES = dict(
    vocab_size=BYTE_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_config(**overrides) -> ModelConfig:
    """A small grouped-query Llama over the byte-level vocabulary (`TINY_SHAPES`); any field can be overridden."""
    return ModelConfig(**(TINY_SHAPES | dict(max_position_embeddings=256, eos_token_id=256) | overrides))


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float64 weights for every parameter of `config`, deterministic for `seed`.

    Norm weights are 1 + small noise, embeddings are standard normal, projections have std 1/sqrt(fan_in) so that
    a tiny random model gives logits of order 1, and biases are small.
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in param_shapes(config).items():
        noise = rng.standard_normal(shape)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            weights[name] = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            weights[name] = noise
        else:
            weights[name] = noise / np.sqrt(shape[1])
    return weights


def random_checkpoint(
    folder: str | Path, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Write a checkpoint folder with `random_weights(config, seed)` and the byte-level tokenizer (its first
    `vocab_size` tokens, for a toy vocabulary)."""
    tokenizer = byte_level_tokenizer(min(config.vocab_size, BYTE_VOCAB))  # never more tokens than the table has
    return save_checkpoint(folder, config, random_weights(config, seed), tokenizer, dtype)


def unrelated_draft(draft_dir: str | Path, folder: str | Path, seed: int = 99) -> Path:
    """A draft that never agrees with its target but by chance, at the real draft's cost: the config and tokenizer
    of `draft_dir` with random weights (the benchmark's never-agreeing pair)."""
    from verispec.checkpoints.config import read_config
    from verispec.checkpoints.tokenizer import load_tokenizer

    config = read_config(draft_dir)
    return save_checkpoint(folder, config, random_weights(config, seed), load_tokenizer(draft_dir))


def random_pair(
    folder: str | Path, config: ModelConfig, draft_layers: int = 1, seed: int = 0, deep_scale: float = 0.2
) -> tuple[Path, Path]:
    """A random target and a draft made of its first `draft_layers` layers (same embeddings, norm and head).

    The target's deeper layers write `deep_scale` times less into the residual stream, so they correct the
    shallow ones rather than replace them and the draft agrees with the target often enough to show speculation.
    """
    weights, tokenizer = random_weights(config, seed), byte_level_tokenizer(min(config.vocab_size, BYTE_VOCAB))
    deep = {name for name in weights if name.startswith("model.layers.") and int(name.split(".")[2]) >= draft_layers}
    for name in deep:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * deep_scale
    target = save_checkpoint(Path(folder) / "target", config, weights, tokenizer)
    kept = {name: value for name, value in weights.items() if name not in deep}
    draft_config = replace(config, num_hidden_layers=draft_layers)
    return target, save_checkpoint(Path(folder) / "draft", draft_config, kept, tokenizer)
