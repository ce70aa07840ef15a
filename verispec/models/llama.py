"""The Llama-family transformer (Llama, Qwen2, Mistral math; Gemma 3's by the fields its config sets: sliding-window
layers, q and k norms, norms around each sublayer, GELU, a scaled embedding), with Hugging Face's parameter names.

Only the math, one path: PyTorch over `nn.Linear`, what training, float64 checks and the transformers comparison run,
over a given layout (models/layout.py). Which layout a forward takes, its captures, exact mode's chunks are
models/execution.py's. The fast paths (prepacked, fused matmuls; verispec's kernels) are subclasses in
models/packed.py that `pack_model` puts in these modules' places; the methods they override here are `Attention`'s
and `MLP`'s projections and `LlamaForCausalLM`'s inputs, LM head and vocabulary heads.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.checkpoints.config import ModelConfig
from verispec.models.batch_cache import BatchLayout
from verispec.models.cache import KVCache
from verispec.models.forward_options import ForwardOptions, VocabHead
from verispec.models.layout import AttentionMask, Layout, Rope, apply_rotary, rotary
from verispec.models.linear import rows_of

Cache = KVCache | BatchLayout  # where a forward stores its keys and values, and reads them back (`update`); None on
# the kernels' batched layout (models/slot_caches.py `SlotsLayout`), whose sequences each store into their own
Ropes = dict[Rope, tuple[torch.Tensor, torch.Tensor]]  # cos, sin of a forward's positions, by RoPE

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}  # `ModelConfig.hidden_act`


def plus(residual: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """residual + y, or y where there is no residual."""
    return y if residual is None else residual + y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of x, plus `residual` where given."""
        # Normalise in float32 at least, as transformers does, so bf16 checkpoints agree with it.
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return plus(residual, self.weight * h.to(x.dtype))


class Embedding(nn.Embedding):
    """The token embedding table."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # (normal_ on the meta device imports torch._dynamo, slowing every load)
            super().reset_parameters()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.kv_heads = layer, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.dim_per_head
        self.window, self.scalar = config.window(layer), config.query_pre_attn_scalar  # what the layout takes
        d, q, kv = config.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, q, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q, d, bias=config.o_bias)
        norms = config.qk_norm  # over each head of q and k, before the rotation
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if norms else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if norms else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Cache | None,
        layout: Layout,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """residual + attention(x) (no residual: attention(x)), over the keys `layout` says each row sees."""
        B, T, _ = x.shape
        q, k, v = self.projections(x)
        q = q.view(B, T, self.heads, self.head_dim)
        k = k.view(B, T, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, Hkv, T, D)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, Hkv, S, D), S = cached + T (a static cache: all its slots)
            k, v = k.to(q.dtype), v.to(q.dtype)  # from a float16 cache: each row's own keys as stored, too
        y = layout.attend(q, k, v, self.window, self.scalar)  # (B, T, H * D)
        return self.output(y, residual)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of x (B, T, D), each (B, T, heads * head size)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def output(self, y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """residual + o(y) (no residual: o(y))."""
        return plus(residual, self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + down(act(gate(x)) * up(x)) (no residual: the rest)."""
        gate, up = self.gate_and_up(x)
        return self.output(ACTIVATIONS[self.act](gate) * up, residual)

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate(x) and up(x)."""
        return self.gate_proj(x), self.up_proj(x)

    def output(self, y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """residual + down(y) (no residual: down(y))."""
        return plus(residual, self.down_proj(y))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(config, layer)
        # The MLP's input norm; with sandwich norms (Gemma's), the attention output's, and the MLP's input norm is
        # pre_feedforward_layernorm
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps)
            self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache | None, layout: Layout
    ) -> torch.Tensor:
        if not self.sandwich:
            x = self.self_attn(self.input_layernorm(x), cos, sin, cache, layout, residual=x)
            return self.mlp(self.post_attention_layernorm(x), residual=x)
        y = self.self_attn(self.input_layernorm(x), cos, sin, cache, layout, residual=None)
        x = self.post_attention_layernorm(y, residual=x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), residual=x)


class Decoder(nn.Module):
    """Named `model` inside `LlamaForCausalLM` so that state-dict keys match Hugging Face's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.scale = config.embedding_scale

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The tokens' embeddings (..., D) in `dtype`, times the config's `embedding_scale` (rounded to `dtype`, as
        transformers' Gemma rounds it) where it has one."""
        x = self.embed_tokens(tokens).to(dtype)
        return x if self.scale is None else x * torch.tensor(self.scale, dtype=dtype, device=x.device)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: its final norm's, which is its embedding table's too but in a quantized twin of a
        bfloat16 model (models/twin.py), which shares the bfloat16 table and runs in float32."""
        return self.model.norm.weight.dtype

    def vocab_head(self, ids: torch.Tensor) -> VocabHead:
        """An LM head over the tokens `ids` (N,) only: their rows of this model's head, in its format."""
        ids = ids.to(torch.int64, copy=True).contiguous()  # its own: programs point into it
        if ids.dim() != 1 or not len(ids) or not 0 <= int(ids.min()) <= int(ids.max()) < self.lm_head.out_features:
            raise ValueError(f"an LM head over {tuple(ids.shape)} token ids, of {self.lm_head.out_features}")
        return VocabHead(ids, rows_of(self.lm_head, ids))

    @property
    def output(self) -> nn.Module:
        """What turns final-normed states into logits over the whole vocabulary: the LM head."""
        return self.lm_head

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Cache | None = None,
        layout: Layout | None = None,
        options: ForwardOptions = ForwardOptions(),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, T - options.logits_from, V) for tokens (B, T) (by `options.head`, over its tokens only) and
        the residual streams `options.hidden` asks for, each (B, T, D), after the blocks `options.layers`.

        The tokens are stored after the cache's positions, and each row sees the keys `layout` says; with no cache
        and no layout (training), they are a whole sequence from position 0, causal unless `options.mask` says
        otherwise. The rotary positions are `options.positions`, 0 .. T - 1 by default.
        """
        run = self.blocks(options.layers)
        hidden = options.hidden or ()
        if not set(hidden) <= {-1, *run}:
            raise ValueError(f"hidden states {list(hidden)} asked of blocks that do not run ({list(run)})")
        positions = options.positions
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        if layout is None:
            layout = AttentionMask(options.mask, causal=options.mask is None)
        x, ropes = self.inputs(tokens, positions, run, layout)
        states = {}
        for i in run:
            x = self.model.layers[i](x, *ropes[self.config.rope(i)], cache, layout)
            states[i] = x
        states[-1] = self.model.norm(x)
        B, T, _ = x.shape
        matmul = options.head.matmul if options.head is not None else self.output
        if options.logits_from >= T:  # no logits asked for (an allocation, which a capture lets through)
            logits = torch.empty(B, 0, matmul.out_features, dtype=x.dtype, device=x.device)
        else:
            logits = matmul(states[-1][:, options.logits_from :])
        return logits, [states[i] for i in hidden]

    def inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor, run: Sequence[int], layout: Layout
    ) -> tuple[torch.Tensor, Ropes]:
        """The first block's input (B, T, D), the tokens' embeddings, and the cos, sin tables of their `positions` for
        each RoPE that the blocks `run` use (the plain math takes any `layout` alike)."""
        config, x = self.config, self.model.embed(tokens, self.dtype)
        ropes = {}
        for theta, factors in dict.fromkeys(config.rope(i) for i in run):
            cos, sin = rotary(positions, config.dim_per_head, theta, x.dtype, factors)
            # a position per row (B, T): broadcast over the heads
            ropes[theta, factors] = (cos[:, None], sin[:, None]) if positions.dim() == 2 else (cos, sin)
        return x, ropes

    def blocks(self, layers: Sequence[int] | None) -> Sequence[int]:
        """The blocks a forward runs: `layers`, or all of them."""
        return range(len(self.model.layers)) if layers is None else layers
