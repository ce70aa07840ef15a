"""The textbook version: a Llama-family forward pass and one greedy speculative decoding step in numpy float64.

No caches, no batching tricks, no torch in the math: every step is written out so it can be read and checked
against Hugging Face transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM`.

Parameters are a dict mapping each Hugging Face weight name (see `param_shapes`) to a float64 array, plus the key
`"config"` holding the `ModelConfig`, so that `full_lm_forward(tokens, params)` needs nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike

from verispec.checkpoints.config import ModelConfig, read_config
from verispec.checkpoints.folder import load_weights
from verispec.checkpoints.random_init import random_weights
from verispec.errors import InvalidArgumentError

Params = dict[str, Any]  # weight name -> float64 ndarray, and "config" -> ModelConfig


def init_params(config: ModelConfig, seed: int = 0) -> Params:
    """Random float64 weights for every parameter of `config` (see `random_weights`), with the config."""
    return {"config": config} | random_weights(config, seed)


def load_params(checkpoint_dir: str | Path) -> Params:
    """Read a checkpoint folder's config and weights, as float64 numpy arrays (config under `"config"`)."""
    config = read_config(checkpoint_dir)
    weights = load_weights(checkpoint_dir, config)
    return {"config": config} | {name: w.to(torch.float64).numpy() for name, w in weights.items()}


def build_causal_mask(n: int) -> np.ndarray:
    """(n, n) bool mask, True where query position i may attend to key position j, i.e. j <= i."""
    return np.tril(np.ones((n, n), dtype=bool))


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * weight


def _linear(x: np.ndarray, params: Params, name: str) -> np.ndarray:
    """y = x W^T (+ b when the checkpoint has a bias for this projection)."""
    y = x @ params[name + ".weight"].T
    bias = params.get(name + ".bias")
    return y if bias is None else y + bias


def _rope(x: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Rotary position embedding, Hugging Face "rotate_half" layout, positions 0..T-1. x: (B, H, T, hd)."""
    seq, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2) / hd)  # (hd/2,)
    if config.rope_factors is not None:  # Llama 3.1's scaling: each frequency divided by its factor
        inv_freq = inv_freq / np.asarray(config.rope_factors)
    freqs = np.outer(np.arange(seq), inv_freq)  # (T, hd/2)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, hd)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    rotated = np.concatenate([-x2, x1], axis=-1)  # rotate_half(x)
    return x * np.cos(emb) + rotated * np.sin(emb)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _attention(x: np.ndarray, params: Params, prefix: str, config: ModelConfig, mask: np.ndarray) -> np.ndarray:
    """Grouped-query self-attention. x: (B, T, D) -> (B, T, D)."""
    batch, seq, _ = x.shape
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.dim_per_head

    def split_heads(y: np.ndarray, n: int) -> np.ndarray:
        return y.reshape(batch, seq, n, hd).transpose(0, 2, 1, 3)  # (B, n, T, hd)

    q = _rope(split_heads(_linear(x, params, prefix + "q_proj"), heads), config)  # (B, H, T, hd)
    k = _rope(split_heads(_linear(x, params, prefix + "k_proj"), kv_heads), config)  # (B, Hkv, T, hd)
    v = split_heads(_linear(x, params, prefix + "v_proj"), kv_heads)  # (B, Hkv, T, hd)
    # Query head h reads kv head h // (H / Hkv): repeat each kv head for its group of query heads.
    k = np.repeat(k, heads // kv_heads, axis=1)  # (B, H, T, hd)
    v = np.repeat(v, heads // kv_heads, axis=1)  # (B, H, T, hd)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)  # (B, H, T, T)
    scores = np.where(mask, scores, -np.inf)
    out = _softmax(scores) @ v  # (B, H, T, hd)
    out = out.transpose(0, 2, 1, 3).reshape(batch, seq, heads * hd)  # (B, T, H*hd)
    return _linear(out, params, prefix + "o_proj")


def _mlp(x: np.ndarray, params: Params, prefix: str) -> np.ndarray:
    """SwiGLU: down(silu(gate(x)) * up(x)). x: (B, T, D) -> (B, T, D)."""
    gate = _linear(x, params, prefix + "gate_proj")  # (B, T, F)
    silu = gate / (1.0 + np.exp(-gate))
    return _linear(silu * _linear(x, params, prefix + "up_proj"), params, prefix + "down_proj")


def full_lm_forward(token_ids: ArrayLike, params: Params, mask: np.ndarray | None = None) -> np.ndarray:
    """Logits (B, T, V) float64 for token ids (B, T) or (T,) (read as batch 1).

    `mask` is a (T, T) bool array, True where attention is allowed; the default is `build_causal_mask(T)`.
    """
    config: ModelConfig = params["config"]
    ids = np.atleast_2d(np.asarray(token_ids, dtype=np.int64))  # (B, T)
    mask = build_causal_mask(ids.shape[1]) if mask is None else np.asarray(mask, dtype=bool)  # (T, T)
    eps = config.rms_norm_eps
    x = params["model.embed_tokens.weight"][ids]  # (B, T, D)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn_in = _rms_norm(x, params[p + "input_layernorm.weight"], eps)
        h = x + _attention(attn_in, params, p + "self_attn.", config, mask)
        x = h + _mlp(_rms_norm(h, params[p + "post_attention_layernorm.weight"], eps), params, p + "mlp.")
    x = _rms_norm(x, params["model.norm.weight"], eps)  # (B, T, D)
    head = params["model.embed_tokens.weight"] if config.tie_word_embeddings else params["lm_head.weight"]  # (V, D)
    return x @ head.T  # (B, T, V)


def greedy_decode(token_ids: ArrayLike, params: Params, num_steps: int) -> np.ndarray:
    """Append `num_steps` argmax tokens to a 1-D prompt, recomputing the full forward pass every step."""
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (T,)
    for _ in range(num_steps):
        logits = full_lm_forward(tokens, params)  # (1, T, V)
        tokens = np.append(tokens, np.argmax(logits[0, -1]))
    return tokens


def speculative_decode_step(
    token_ids: ArrayLike, draft_params: Params, target_params: Params, num_draft_tokens: int
) -> tuple[np.ndarray, int]:
    """One greedy speculative step: the draft proposes, the target checks all proposals in one forward pass.

    Proposals are accepted in order while each equals the target's argmax at its position; the first one that
    does not is replaced by the target's argmax and nothing after it is kept. If all are accepted the result is
    the target's own greedy continuation (this textbook step adds no bonus token). Returns the new 1-D token
    sequence and the number of accepted draft tokens.
    """
    prompt = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (n,)
    n, k = len(prompt), num_draft_tokens
    if n == 0:
        raise InvalidArgumentError("speculative decoding needs a non-empty prompt")
    drafted = greedy_decode(prompt, draft_params, k)  # (n + k,)
    proposals = drafted[n:]  # (k,)
    logits = full_lm_forward(drafted, target_params, build_causal_mask(n + k))  # (1, n + k, V)
    # The logits at position n-1+i predict token n+i, the i-th proposal.
    target_choice = np.argmax(logits[0, n - 1 : n - 1 + k], axis=-1)  # (k,)
    accepted = 0
    while accepted < k and proposals[accepted] == target_choice[accepted]:
        accepted += 1
    if accepted == k:
        return drafted, k
    return np.concatenate([prompt, proposals[:accepted], target_choice[accepted : accepted + 1]]), accepted
