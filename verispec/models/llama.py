"""The Llama-family transformer (Llama, Qwen2, Mistral math), with the same parameter names as Hugging Face."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels
from verispec.errors import ContextLengthError
from verispec.models.batch_cache import BatchRows
from verispec.models.cache import KVCache
from verispec.models.captured import lookup, replay, replay_causal, replay_chain
from verispec.models.config import ModelConfig
from verispec.models.linear import PackedLinear, packed_here
from verispec.sampling import argmax


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.own_kernel = False  # set by `Block.pack`: verispec's kernel, in inference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_kernel and x.dtype == self.weight.dtype and packed_here(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 at least, as transformers does, so bf16 checkpoints agree with it.
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (..., T, D) for the given positions (..., T), computed like transformers (float32, then
    cast)."""
    compute = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=compute) / head_dim)
    freqs = positions.to(compute)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_table(positions: int, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (positions, D) for positions 0 .. positions - 1, for verispec's kernels to read by index. Taken in
    float64 and rounded, so that a row's values do not depend on the table's length (vectorised float32 cos and sin
    may round a tensor's last elements differently)."""
    inv_freq = (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).double()
    freqs = torch.arange(positions, dtype=torch.float32)[:, None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float().to(dtype).contiguous(), emb.sin().float().to(dtype).contiguous()


def covering(table: tuple[torch.Tensor, torch.Tensor] | None, slots: int, config: ModelConfig, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`table` (cos, sin by position), or a longer one where it does not cover a cache of `slots`: kernel forwards
    read their rotary rows from it (a row's values do not depend on the table's length)."""
    if table is None or len(table[0]) < slots:
        return rotary_table(slots, config.dim_per_head, config.rope_theta, dtype)
    return table


def as_index(positions: torch.Tensor) -> torch.Tensor:
    """Positions as the rotary rows' gather takes them: a contiguous int64 vector."""
    if positions.dim() != 1 or positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.reshape(-1).to(torch.int64).contiguous()
    return positions


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


LONG_ROWS = 256  # exact mode's chunks on verispec's attention, where they bound only memory (see `_exact`)
TAIL = 32  # a row's last TAIL keys are gathered into position order; the rest are used where they sit


@dataclass
class Rows:
    """Exact mode's attention layout for one forward of R rows (a static cache: `cache.rows` is set).

    A row's result must not depend on the other rows, nor on where its keys sit (a token tree's nodes sit in
    slots past their positions), so each row reduces over a key layout fixed by its own count C of visible keys
    (its position + 1): the W = `cache.width` cache slots in place, of which it sees slots 0..C-TAIL-1 (positions
    0..C-TAIL-1: committed tokens, or a chain's, which sit at slot == position), then TAIL tail keys, its last
    positions C-TAIL..C-1 gathered from wherever they sit. Every reduction over keys then adds the same numbers
    at the same indices whether the token is decoded alone, in a chain, in a tree or in a prefill chunk, and only
    the short tail is copied. A tree deeper than TAIL would leave out-of-place keys in the prefix: it is refused.
    """

    tail: torch.Tensor  # (R, TAIL) the cache slot gathered into each tail key of each row
    bias: torch.Tensor  # (R, 1, W + TAIL) over [prefix | tail] keys: 0 where the row sees the key, -inf elsewhere
    span: int  # the slots that any row sees lie below this multiple of 64: only their scores are taken

    @staticmethod
    def of(visible: torch.Tensor, width: int) -> Rows:
        """The layout of rows that see the cache slots `visible` (R, P), True where seen, P >= width."""
        count, device = visible.sum(-1), visible.device  # (R,)
        if int(count.max()) > width:
            raise ContextLengthError(f"exact mode attends over at most {width} keys; a token here sees "
                                     f"{int(count.max())}")
        first = (count - TAIL).clamp(min=0)[:, None]  # (R, 1) a row's first tail position
        slot = torch.arange(visible.shape[-1], device=device)
        if not (visible | (slot >= first)).all():
            raise ValueError(f"exact mode: a token here sees keys out of position order more than {TAIL} positions "
                             f"back (a token tree more than {TAIL} deep)")
        position = visible.cumsum(-1) - 1  # (R, P) of each seen slot: a row's slots hold its positions in order
        row, seen = (visible & (position >= first)).nonzero(as_tuple=True)
        tail = torch.zeros(len(count), TAIL, dtype=torch.long, device=device)
        tail[row, position[row, seen] - first[row, 0]] = seen
        keys = torch.cat((slot[:width] < first, torch.arange(TAIL, device=device) < count[:, None] - first), -1)
        bias = torch.zeros(keys.shape, device=device).masked_fill_(~keys, float("-inf"))
        last = int(visible.any(0).nonzero().max()) + 1
        return Rows(tail, bias[:, None], min(-(-last // 64) * 64, visible.shape[-1]))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, R, D) and the whole cache's k, v (1, Hkv, P, D) -> (1, R, H * D).

        Explicit matmuls, not scaled_dot_product_attention: its float32 CPU kernel gives a row a different result
        on another thread, and which thread takes a row depends on the row's index. A score is one dot product,
        the same whatever the number of keys and wherever its key sits (measured), so the scores are taken
        against the slots that some row sees, the tail's gathered from them, and the prefix's padded to the fixed
        width W. The softmax runs jointly over [prefix | tail] in float32; the prefix's values are used in place,
        in one matmul of width W for all rows (an unseen slot adds an exact zero: the cache is zeroed, so its
        values are finite), and each row's tail values are gathered. The three matmuls run at the forward's row
        count, at or above the model's row floor (models/row_floor.py).
        """
        _, H, R, D = q.shape
        Hkv, W, span = k.shape[1], self.bias.shape[-1] - TAIL, self.span
        G = H // Hkv
        q = q[0].view(Hkv, G, R, D).transpose(1, 2).reshape(Hkv, -1, D)  # (Hkv, R * G, D), row by row
        scores = ((q.float() * D ** -0.5) @ k[0, :, :span].float().transpose(-1, -2)).view(Hkv, R, G, span)
        tail = scores.gather(-1, self.tail[None, :, None].expand(Hkv, R, scores.shape[2], TAIL))
        prefix = F.pad(scores, (0, W - span), value=float("-inf"))  # cut instead where span > W (slots > W)
        p = (torch.cat((prefix, tail), -1) + self.bias).softmax(-1).to(v.dtype)  # (Hkv, R, G, W + TAIL)
        y = (p[..., :W].reshape(Hkv, -1, W) @ v[0, :, :W]).view(Hkv, R, -1, D)  # (Hkv, R, G, D)
        y = y + p[..., W:] @ v[0].index_select(1, self.tail.flatten()).view(Hkv, R, TAIL, D)
        return y.permute(1, 0, 2, 3).reshape(1, R, H * D)


@dataclass
class KeyRows:
    """Attention through verispec's kernels (verispec/kernels), one sequence into a `KVCache`: each row's softmax over
    exactly the cache slots it sees, taken in slot order, the others skipped rather than masked. A row then adds the
    same numbers in the same order whether its token is decoded alone, in a chain, in a tree (whose nodes sit past
    their positions, but in position order) or in a prefill chunk, at no fixed width and with no limit on a tree's
    depth: exact mode at no cost. A forward laid out this way runs nothing but kernels, so it is captured and replayed
    (models/captured.py).
    """

    visible: torch.Tensor  # (R, slots) uint8, 1 where the row sees the cache slot

    @staticmethod
    def of(visible: torch.Tensor) -> KeyRows:
        """Rows that see the cache slots `visible` (R, slots), True where seen."""
        return KeyRows(visible.to(torch.uint8).contiguous())

    @staticmethod
    def seeing(mask: torch.Tensor | None, T: int, start: int, slots: int) -> KeyRows:
        """For T new tokens after `start` cached ones, in a cache of `slots`: `mask` (T, start + T) says which slots
        each sees; None (one token), all of them."""
        visible = torch.zeros(T, slots, dtype=torch.uint8)
        visible[:, : start + T] = 1 if mask is None else mask
        return KeyRows(visible)


@dataclass(eq=False)
class VocabHead:
    """An LM head over part of the vocabulary (a drafter's reduced vocabulary, as in FR-Spec and EAGLE-3): logits for
    the tokens `ids` only, in that order, for a fraction of the full head's cost (`LlamaForCausalLM.vocab_head`)."""

    ids: torch.Tensor  # (N,) int64 token ids
    matmul: nn.Module  # final-normed states (..., D) -> (..., N)


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
        self.qkv: PackedLinear | None = None  # set by `LlamaForCausalLM.pack`, used instead of the linears
        self.o: PackedLinear | None = None
        self.own_attention = False  # set by `Block.pack`: attention through `KeyRows` on verispec's kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | BatchRows | None,
                mask: torch.Tensor | Rows | KeyRows | None, residual: torch.Tensor) -> torch.Tensor:
        """residual + attention(x)."""
        if isinstance(mask, KeyRows):
            return self._own(x, cos, sin, cache, mask, residual)
        B, T, _ = x.shape
        q, k, v = self.qkv.parts(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, Hkv, S, D), S = cached + T (a static cache: all its slots)
        if isinstance(mask, Rows):
            y = mask.attend(q, k, v)  # (B, T, H * D)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None and mask is None,
                                               enable_gqa=self.heads != self.kv_heads).transpose(1, 2).reshape(B, T, -1)
        return self.o(y, residual) if self.o is not None else residual + self.o_proj(y)

    def _own(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, rows: KeyRows,
             residual: torch.Tensor) -> torch.Tensor:
        """The same on verispec's kernels, one sequence (B = 1): kernel calls on views of the projections' output."""
        T, D, H, Hkv = x.shape[1], self.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(x)[0]  # (T, (H + 2 Hkv) D): q heads, k heads, v heads
        kernels.rotary_(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D).transpose(0, 1), cos, sin)  # q and k, in place
        keys, values = cache.store(self.layer, qkv[:, H * D: (H + Hkv) * D], qkv[:, (H + Hkv) * D:])
        y = kernels.attend(qkv[:, : H * D].view(T, H, D).transpose(0, 1), keys, values, rows.visible)  # (T, H * D)
        return self.o(y[None], residual)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up: PackedLinear | None = None  # set by `LlamaForCausalLM.pack`, used instead of the linears
        self.down: PackedLinear | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + down(silu(gate(x)) * up(x))."""
        if self.gate_up is not None and self.gate_up.kernel is not None and packed_here(x):
            return self.down(kernels.silu_mul(self.gate_up(x)), residual)  # verispec's kernels
        gate, up = self.gate_up.parts(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        y = F.silu(gate) * up
        return self.down(y, residual) if self.down is not None else residual + self.down_proj(y)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def pack(self, rows: int, own_kernels: bool | None = None) -> None:
        """Run the projections as prepacked matmuls laid out for `rows` rows, q, k, v and gate, up fused (see
        models/linear.py; `own_kernels`: verispec's, by default `kernels.chosen`): an inference-only fast path."""
        attention, mlp = self.self_attn, self.mlp
        weight = attention.o_proj.weight
        if own_kernels is None:
            own_kernels = kernels.chosen(weight.dtype, weight.device)
        elif own_kernels and not kernels.available(weight.dtype, weight.device):
            raise ValueError(f"verispec's kernels do not run {weight.dtype} here: {kernels.reason()}")
        attention.own_attention = own_kernels and attention.head_dim <= kernels.MAX_HEAD_DIM
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            if isinstance(norm, RMSNorm):  # EAGLE's layer has none at its input
                norm.own_kernel = own_kernels
        attention.qkv = PackedLinear([attention.q_proj, attention.k_proj, attention.v_proj], rows, own_kernels)
        attention.o = PackedLinear([attention.o_proj], rows, own_kernels)
        mlp.gate_up = PackedLinear([mlp.gate_proj, mlp.up_proj], rows, own_kernels)
        mlp.down = PackedLinear([mlp.down_proj], rows, own_kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | BatchRows | None,
                mask: torch.Tensor | Rows | KeyRows | None) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


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
        self.head: PackedLinear | None = None  # set by `pack`, used instead of lm_head
        self.own_kernels = False  # set by `pack`: verispec's kernels run the matmuls, norms and rotary
        self.own_attention = False  # and attention (`KeyRows`), where they take the head size
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin by position, for `KeyRows` forwards
        self.capture = True  # replay a `KeyRows` forward's captured kernel calls (models/captured.py); False: op by op
        self.captured: dict = {}  # those captures by shape (models/captured.py `replay`)
        # Exact mode's row floor by (threads, rows, width), measured on first use (see `row_floor`)
        self.row_floors: dict[tuple[int, int, int], int] = {}

    def pack(self, rows: int, own_kernels: bool | None = None) -> None:
        """Run every projection and the LM head as prepacked matmuls laid out for `rows` rows, q, k, v and gate, up
        fused (see models/linear.py): an inference-only fast path. The parameters keep their names and values.
        `own_kernels` (by default `kernels.chosen`: where this machine has them and torch runs one thread): verispec's
        kernels run the matmuls, norms, rotary and, where they take the head size, attention (`KeyRows`)."""
        param = self.lm_head.weight
        self.own_kernels = kernels.chosen(param.dtype, param.device) if own_kernels is None else own_kernels
        for block in self.model.layers:
            block.pack(rows, self.own_kernels)
        self.own_attention = self.model.layers[0].self_attn.own_attention if self.model.layers else False
        self.model.norm.own_kernel = self.own_kernels
        self.head = PackedLinear([self.lm_head], rows, self.own_kernels)
        self.rope, self.captured = None, {}

    def exact_rows(self, visible: torch.Tensor, width: int) -> Rows | KeyRows:
        """Exact mode's attention layout for rows that see the cache slots `visible` (R, P), keys `width` wide."""
        return KeyRows.of(visible) if self.own_attention else Rows.of(visible.bool(), width)

    def row_floor(self, rows: int, width: int) -> int:
        """The fewest rows an exact-mode forward (chunks of at most `rows`, keys `width` wide) pads to: measured on
        this machine's kernels at the current thread count, once per count (models/row_floor.py). Unpacked, every
        forward pads to `rows`: the plain projections leave contiguous (rows x width) outputs, over which an
        elementwise kernel (silu) ends its vector loop on a row that depends on the count; the packed ones leave
        strided views, taken row by row."""
        if self.head is None:
            return rows
        if self.own_attention:  # (implies own_kernels)
            return 1  # batch-invariant by construction (verispec/kernels); tests/test_row_floor.py measures it so
        key = (torch.get_num_threads(), rows, width)
        if key not in self.row_floors:
            from verispec.models.row_floor import row_floor  # here: it imports this module's rotary
            self.row_floors[key] = row_floor(self, rows, width)
        return self.row_floors[key]

    def vocab_head(self, ids: torch.Tensor) -> VocabHead:
        """An LM head over the tokens `ids` (N,) only: their rows of this model's head, packed as it is."""
        ids = ids.to(torch.int64, copy=True).contiguous()  # its own: programs point into it
        if ids.dim() != 1 or not len(ids) or not 0 <= int(ids.min()) <= int(ids.max()) < self.lm_head.out_features:
            raise ValueError(f"an LM head over {tuple(ids.shape)} token ids, of {self.lm_head.out_features}")
        linear = nn.Linear(self.config.hidden_size, len(ids), bias=False, device="meta")
        linear.weight = nn.Parameter(self.lm_head.weight.detach()[ids], requires_grad=False)
        return VocabHead(ids, linear if self.head is None else PackedLinear([linear], self.head.rows, self.own_kernels))

    def forward(self, tokens: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                hidden: Sequence[int] | None = None, logits_to_keep: int = 0, head: VocabHead | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) for T new tokens (B, T) stored after the cache's `length` positions; with
        `logits_to_keep` n > 0, of the last n tokens only (B, n, V), as in transformers: a prefill whose logits
        are thrown away skips the LM head, a sixth of this family's small models.

        `mask` (T, T), True where new token i may attend to new token j, replaces the causal
        pattern among the new tokens; every new token always sees the whole cache. A mask
        (T, cache.length + T) covers the cache too (a draft model's own tree entries). `positions` (T,)
        are the rotary positions, cache.length + index by default; a token tree passes
        cache.length + depth, so that siblings share a position. With no cache (training), the
        tokens are a whole sequence from position 0. `layers` (indices, ascending) are the blocks to run,
        all by default: a skipped block neither computes nor writes its cache entries for the new tokens, so
        they hold stale values, and only a caller that truncates them away (layer-skip drafting) may skip.
        `hidden` (block indices, or -1 for the final-normed state) asks for (logits, hidden (B, T, len(hidden), D)):
        the residual stream after each chosen block, the features that EAGLE and Medusa heads read. `head`: logits
        over its tokens only (B, T, N), from an LM head over part of the vocabulary (`vocab_head`).

        Into a static cache (`cache.rows` set: exact mode) a forward runs in chunks (of `cache.rows` rows, or
        `LONG_ROWS` on verispec's attention), each padded up to the `row_floor` and laid out by `exact_rows`, so that a
        position's logits are bitwise the same however many tokens share the forward; a chunk sees earlier chunks
        through the cache, so no token may see a later chunk's.
        """
        T = tokens.shape[1]
        start = 0
        if cache is not None:
            cache.reserve(T)
            start = cache.length
        first = max(T - logits_to_keep, 0) if logits_to_keep else 0  # the first row whose logits are returned
        if mask is None and positions is None and self._captured(tokens, cache):  # a decoding step, most often
            capture = lookup(self.captured, self._key(T, first, self._blocks(layers), hidden or (), cache, head))
            if capture is not None:
                logits, states = replay_causal(capture, cache, tokens)
                cache.advance(T)
                return logits if hidden is None else (logits, torch.stack(states, dim=2))
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)
        if cache is not None and cache.rows is not None:
            return self._exact(tokens, cache, mask, positions, layers, hidden, first, head)
        attn_mask = mask
        if mask is not None and cache is not None and mask.shape[-1] == start + T:
            attn_mask = mask.to(tokens.device)  # it already says which cached positions each token sees
        elif cache is not None and (T > 1 or mask is not None):
            new = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril() if mask is None else mask
            seen = torch.ones(T, start, dtype=torch.bool, device=tokens.device)
            attn_mask = torch.cat((seen, new.to(tokens.device)), dim=1)  # (T, start + T)
        if self._key_rows(tokens, cache):  # each row over its own keys
            attn_mask = KeyRows.seeing(attn_mask, T, start, cache.slots)
        out = self._run(tokens, positions, cache, attn_mask, layers, hidden, first, head)
        if cache is not None:
            cache.advance(T)
        return out

    def chain(self, tokens: torch.Tensor, cache: KVCache, n: int, vocab: int, head: VocabHead | None = None
              ) -> list[int]:
        """n tokens of greedy decoding after `tokens` (1, T), each the argmax of the first `vocab` logits after the one
        before (with `head`, of its logits, over its tokens: a drafter's reduced vocabulary): a forward of the T
        tokens, then n - 1 forwards of one token, the cache T + n - 1 longer. On
        verispec's kernels (`KeyRows`), once both shapes are captured (a forward of T tokens whose last row's logits
        are kept, and one of a token), the chain runs them as one program, each argmax made the next forward's input
        by a kernel (models/captured.py `replay_chain`); until then, and elsewhere, a forward at a time (which
        captures them). A prompt (more than two tokens) runs as an ordinary forward (in chunks in exact mode) and the
        chain from its last token. If a chain fails, the cache is left as it was."""
        cache.reserve(tokens.shape[1] + n - 1)
        start, run = cache.length, self._blocks(None)
        try:
            own = self._captured(tokens, cache)
            if own and tokens.shape[1] > 2:
                self(tokens[:, :-1], cache, logits_to_keep=1)
                tokens = tokens[:, -1:]
            T, ids = tokens.shape[1], None if head is None else head.ids
            vocab = vocab if head is None else len(ids)
            first = lookup(self.captured, self._key(T, T - 1, run, (), cache, head)) if own else None
            step = first if T == 1 else lookup(self.captured, self._key(1, 0, run, (), cache, head)) if own else None
            if first is None or step is None:
                out, x = [], tokens
                while len(out) < n:
                    best = int(argmax(self(x, cache, logits_to_keep=1, head=head)[0, -1, :vocab]))
                    out.append(best if ids is None else int(ids[best]))
                    x = torch.tensor([out[-1:]], device=tokens.device)
                return out
            return replay_chain(first, step, cache, tokens, n, vocab, ids)
        except BaseException:
            cache.truncate(start)  # as if the chain never ran
            raise

    def _key_rows(self, tokens: torch.Tensor, cache: KVCache | None) -> bool:
        """Whether a forward of `tokens` into `cache` attends through verispec's kernels, each row over its own keys
        (`KeyRows`): one sequence into a cache, in inference."""
        return self.own_attention and cache is not None and tokens.shape[0] == 1 and packed_here(tokens)

    def _captured(self, tokens: torch.Tensor, cache: KVCache | None) -> bool:
        """Whether a forward of `tokens` into `cache` runs as captured programs: `KeyRows`, with capture on."""
        return self.capture and self._key_rows(tokens, cache)

    def _blocks(self, layers: Sequence[int] | None) -> Sequence[int]:
        """The blocks a forward runs: `layers`, or all of them."""
        return range(len(self.model.layers)) if layers is None else layers

    def _key(self, T: int, first: int, run: Sequence[int], hidden: Sequence[int], cache: KVCache,
             head: VocabHead | None) -> tuple:
        """A `KeyRows` forward's shape, by which it is captured: rows, logits from row `first`, blocks run, states
        asked for, the cache's layout, the LM head."""
        return T, first, tuple(run), tuple(hidden), tuple(cache.k.shape), cache.k.dtype, head

    def forward_rows(self, tokens: torch.Tensor, rows: BatchRows, head: VocabHead | None = None) -> torch.Tensor:
        """Logits (B, T, V) for a batch of sequences, row b continuing its own cache slot (`BatchRows`: each row's
        offset, its real tokens and its padding); each slot advances by its row's real tokens only. `head`: over its
        tokens only (B, T, N)."""
        out = self._run(tokens, rows.positions, rows, rows.mask, None, None, 0, head)
        rows.advance()
        return out

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | BatchRows | None,
             attn_mask: torch.Tensor | Rows | KeyRows | None, layers: Sequence[int] | None,
             hidden: Sequence[int] | None, first: int, head: VocabHead | None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward's logits from row `first` on, by `head` if given (all the rows' hidden states)."""
        run = self._blocks(layers)
        if hidden is not None and not set(hidden) <= {-1, *run}:
            raise ValueError(f"hidden states {list(hidden)} asked of blocks that do not run ({list(run)})")
        if isinstance(attn_mask, KeyRows):  # one sequence on verispec's kernels
            self.rope = covering(self.rope, cache.slots, self.config, self.lm_head.weight.dtype)
            positions = as_index(positions)
        if isinstance(attn_mask, KeyRows) and self.capture:  # nothing but kernels: captured once per shape, replayed
            key = self._key(tokens.shape[1], first, run, hidden or (), cache, head)
            logits, states = replay(self.captured, key, cache, lambda t, p, rows: self._layers(
                t, p, cache, rows, run, hidden or (), first, head), (tokens, positions), attn_mask)
        else:
            logits, states = self._layers(tokens, positions, cache, attn_mask, run, hidden or (), first, head)
        return logits if hidden is None else (logits, torch.stack(states, dim=2))

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | BatchRows | None,
                attn_mask: torch.Tensor | Rows | KeyRows | None, run: Sequence[int], hidden: Sequence[int],
                first: int, head: VocabHead | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits from row `first` on (by `head`, else the whole LM head) and the residual streams `hidden` asks
        for, after running the blocks `run`."""
        if isinstance(attn_mask, KeyRows):  # one sequence: rows of the embedding and rotary tables by verispec's kernel
            x = kernels.gather(self.model.embed_tokens.weight, tokens[0])[None]  # (1, T, D)
            cos, sin = kernels.gather(self.rope[0], positions), kernels.gather(self.rope[1], positions)
        else:
            x = self.model.embed_tokens(tokens)  # (B, T, D)
            cos, sin = rotary(positions, self.config.dim_per_head, self.config.rope_theta, x.dtype)
            if positions.dim() == 2:  # a position per row (B, T): broadcast over the heads
                cos, sin = cos[:, None], sin[:, None]
        states = {}
        for i in run:
            x = self.model.layers[i](x, cos, sin, cache, attn_mask)
            states[i] = x
        states[-1] = self.model.norm(x)
        B, T, _ = x.shape
        matmul = head.matmul if head is not None else self.head or self.lm_head
        if first >= T:  # no logits asked for (an allocation, which a capture lets through, unlike new_empty)
            logits = torch.empty(B, 0, matmul.weight.shape[0], dtype=x.dtype, device=x.device)
        else:
            logits = matmul(states[-1][:, first:])
        return logits, [states[i] for i in hidden]

    def _exact(self, tokens: torch.Tensor, cache: KVCache, mask: torch.Tensor | None, positions: torch.Tensor,
               layers: Sequence[int] | None, hidden: Sequence[int] | None, keep_from: int, head: VocabHead | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward into a static cache, logits from row `keep_from` on: chunks of at most R rows, each padded to
        the row floor and laid out by `exact_rows`. On verispec's attention (row floor 1) a row's result does not depend on the rows beside it,
        so chunks only bound memory: they are `LONG_ROWS` long, and a prefill streams the weights a sixteenth as
        often as in chunks of `cache.rows`."""
        B, T = tokens.shape
        if B != 1:
            raise ValueError(f"exact mode runs one sequence at a time; got a batch of {B}")
        start, slots, device = cache.length, cache.slots, tokens.device
        floor = self.row_floor(cache.rows, cache.width)
        R = LONG_ROWS if self.own_attention else cache.rows
        # (T, P) the cache slots each token sees, as `KeyRows` takes them (uint8) or `Rows` (bool)
        visible = torch.zeros(T, slots, dtype=torch.uint8 if self.own_attention else torch.bool, device=device)
        if mask is not None and mask.shape[-1] == start + T:
            visible[:, : start + T] = mask.to(device)
        else:
            visible[:, :start] = True
            visible[:, start: start + T] = torch.ones(T, T, dtype=visible.dtype, device=device).tril() if mask is None \
                else mask.to(device)
        if T > R and any(visible[c: c + R, start + c + R:].any() for c in range(0, T - R, R)):
            raise ValueError(f"exact mode runs {T} tokens as chunks of {R}; a token here sees a later chunk's")
        logits, states = [], []
        try:
            for c in range(0, T, R):
                n = min(R, T - c)
                m = max(n, floor)  # the rows run
                rows, x, where = visible[c: c + n], tokens[:, c: c + n], positions[c: c + n]
                if n < floor:
                    # Padding rows (token 0 at position 0) see slot 0 only: any finite result will do, as they are
                    # written past the real rows, where no real row looks.
                    rows = torch.cat((rows, torch.zeros(floor - n, slots, dtype=rows.dtype, device=device)))
                    rows[n:, 0] = True
                    x, where = F.pad(x, (0, floor - n)), F.pad(where, (0, floor - n))
                # The LM head from the chunk's first row asked for, or not at all; a padded chunk's (PyTorch's
                # kernels) over all its rows or none, as its row floor was measured
                first = min(max(keep_from - c, 0), n)
                first = m if first == n else first if floor == 1 else 0
                out = self._run(x, where, cache, self.exact_rows(rows, cache.width), layers, hidden, first, head)
                out = (out, None) if hidden is None else out
                logits.append(out[0][:, : max(n - first, 0)])
                states.append(None if hidden is None else out[1][:, :n])
                cache.advance(n)
        except BaseException:
            cache.truncate(start)  # as if the forward never ran
            raise
        logits = logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)
        logits = logits[:, logits.shape[1] - (T - keep_from):]  # a padded chunk's head ran from its first row
        if hidden is None:
            return logits
        return logits, states[0] if len(states) == 1 else torch.cat(states, dim=1)
