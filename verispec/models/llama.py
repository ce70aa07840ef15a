"""The Llama-family transformer (Llama, Qwen2, Mistral math), with the same parameter names as Hugging Face."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.cache import KVCache
from verispec.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 at least, as transformers does, so bf16 checkpoints agree with it.
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (T, D) for the given positions, computed like transformers (float32, then cast)."""
    compute = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=compute) / head_dim)
    freqs = positions.to(compute)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.kv_heads = layer, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.dim_per_head
        d, q, kv = config.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, q, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q, d, bias=config.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, Hkv, S, D), S = cached + T
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None and mask is None,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Named `model` inside `LlamaForCausalLM` so that state-dict keys match Hugging Face's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                hidden: Sequence[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) for T new tokens (B, T) stored after the cache's `length` positions.

        `mask` (T, T), True where new token i may attend to new token j, replaces the causal
        pattern among the new tokens; every new token always sees the whole cache. A mask
        (T, cache.length + T) covers the cache too (a draft model's own tree entries). `positions` (T,)
        are the rotary positions, cache.length + index by default; a token tree passes
        cache.length + depth, so that siblings share a position. With no cache (training), the
        tokens are a whole sequence from position 0. `layers` (indices, ascending) are the blocks to run,
        all by default: a skipped block neither computes nor writes its cache entries for the new tokens, so
        they hold stale values, and only a caller that truncates them away (layer-skip drafting) may skip.
        `hidden` (block indices, or -1 for the final-normed state) asks for (logits, hidden (B, T, len(hidden), D)):
        the residual stream after each chosen block, the features that EAGLE and Medusa heads read.
        """
        B, T = tokens.shape
        start = 0
        if cache is not None:
            cache.reserve(T)
            start = cache.length
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)
        x = self.model.embed_tokens(tokens)  # (B, T, D)
        cos, sin = rotary(positions, self.config.dim_per_head, self.config.rope_theta, x.dtype)
        attn_mask = mask
        if mask is not None and cache is not None and mask.shape[-1] == start + T:
            attn_mask = mask.to(tokens.device)  # it already says which cached positions each token sees
        elif cache is not None and (T > 1 or mask is not None):
            new = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril() if mask is None else mask
            seen = torch.ones(T, start, dtype=torch.bool, device=tokens.device)
            attn_mask = torch.cat((seen, new.to(tokens.device)), dim=1)  # (T, start + T)
        run = range(len(self.model.layers)) if layers is None else layers
        if hidden is not None and not set(hidden) <= {-1, *run}:
            raise ValueError(f"hidden states {list(hidden)} asked of blocks that do not run ({list(run)})")
        states = {}
        for i in run:
            x = self.model.layers[i](x, cos, sin, cache, attn_mask)
            states[i] = x
        if cache is not None:
            cache.advance(T)
        states[-1] = self.model.norm(x)
        logits = self.lm_head(states[-1])
        return logits if hidden is None else (logits, torch.stack([states[i] for i in hidden], dim=2))
