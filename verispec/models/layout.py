"""A forward's layout: the rotary tables, and which keys each row of a forward sees, laid out for one attention path.

The math (models/llama.py) runs over whichever layout it is given; models/execution.py picks it. Three layouts:
- `AttentionMask`: PyTorch's scaled_dot_product_attention with a boolean mask (or causal, or none);
- `FixedWidthKeys`: exact mode on PyTorch's kernels, every row over the same key width;
- `VisibleSlots`: verispec's kernels, each row over exactly the cache slots it sees (`on_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
import torch.nn.functional as F

from verispec import kernels
from verispec.checkpoints.config import ModelConfig
from verispec.errors import ContextLengthError
from verispec.models.cache import KVCache

TAIL = 32  # a row's last TAIL keys are gathered into position order; the rest are used where they sit


def inverse_frequencies(
    head_dim: int,
    theta: float,
    factors: Sequence[float] | None,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(D / 2,) each pair of dimensions' rotary frequency, computed like transformers in `dtype`; each divided by its
    factor (llama.cpp's rope_freqs: Llama 3.1's scaling) where there are `factors`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    return inv_freq if factors is None else inv_freq / torch.tensor(factors, dtype=dtype, device=device)


def rotary(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, factors: Sequence[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (..., T, D) for the given positions (..., T), computed like transformers (float32, then
    cast); frequencies divided by `factors` (`ModelConfig.rope_factors`) where given."""
    compute = torch.promote_types(dtype, torch.float32)
    inv_freq = inverse_frequencies(head_dim, theta, factors, compute, positions.device)
    freqs = positions.to(compute)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_table(
    positions: int, head_dim: int, theta: float, dtype: torch.dtype, factors: Sequence[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (positions, D) for positions 0 .. positions - 1, for verispec's kernels to read by index. Taken in
    float64 and rounded, so that a row's values do not depend on the table's length (vectorised float32 cos and sin
    may round a tensor's last elements differently); the frequencies are `rotary`'s float32 ones."""
    inv_freq = inverse_frequencies(head_dim, theta, factors, torch.float32).double()
    freqs = torch.arange(positions, dtype=torch.float32)[:, None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float().to(dtype).contiguous(), emb.sin().float().to(dtype).contiguous()


Table = tuple[torch.Tensor, torch.Tensor]  # cos, sin by position
Rope = tuple[float, tuple[float, ...] | None]  # a RoPE's base and frequency factors (`ModelConfig.rope`)


def covering(
    table: Table | None, slots: int, config: ModelConfig, dtype: torch.dtype, rope: Rope | None = None
) -> Table:
    """`table` (cos, sin by position), or a longer one where it does not cover a cache of `slots`: kernel forwards
    read their rotary rows from it (a row's values do not depend on the table's length). `rope`: by default the
    config's (its global layers')."""
    if table is None or len(table[0]) < slots:
        theta, factors = rope or (config.rope_theta, config.rope_factors)
        return rotary_table(slots, config.dim_per_head, theta, dtype, factors)
    return table


def covering_all(tables: dict[Rope, Table] | None, slots: int, config: ModelConfig, dtype: torch.dtype) -> dict:
    """`covering` for each RoPE the model's layers use (one, but Gemma's two), by RoPE."""
    ropes = dict.fromkeys(config.rope(i) for i in range(config.num_hidden_layers))
    return {rope: covering((tables or {}).get(rope), slots, config, dtype, rope) for rope in ropes}


def in_window(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A boolean mask (..., S) of the keys each row sees, cut to the last `window` of them in slot order (a sliding
    window: a row's slots hold its positions in order, so those are its last `window` positions)."""
    after = mask.flip(-1).cumsum(-1).flip(-1)  # the seen keys at or after each slot
    return mask & (after <= window)


def as_index(positions: torch.Tensor) -> torch.Tensor:
    """Positions as the rotary rows' gather takes them: a contiguous int64 vector."""
    if positions.dim() != 1 or positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.reshape(-1).to(torch.int64).contiguous()
    return positions


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def visible_slots(
    mask: torch.Tensor | None, T: int, start: int, slots: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """(T, slots) the cache slots each of T new tokens after `start` cached ones sees: `mask` (T, start + T) says
    so; `mask` (T, T) says which new tokens each sees, besides every cached one; None, causally."""
    visible = torch.zeros(T, slots, dtype=dtype, device=device)
    if mask is not None and mask.shape[-1] == start + T:
        visible[:, : start + T] = mask.to(device)
    else:
        visible[:, :start] = True
        visible[:, start : start + T] = (
            torch.ones(T, T, dtype=dtype, device=device).tril() if mask is None else mask.to(device)
        )
    return visible


@dataclass
class AttentionMask:
    """PyTorch's scaled_dot_product_attention over the keys a cache returns: `mask` (T, S) or (B, 1, T, S), True
    where a row sees a key; none with `causal`, each row sees itself and the rows before it; none without, all."""

    mask: torch.Tensor | None = None
    causal: bool = False
    on_kernels: ClassVar[bool] = False

    @staticmethod
    def over_cache(mask: torch.Tensor | None, T: int, start: int, device: torch.device | str) -> AttentionMask:
        """For T new tokens after `start` cached ones: `mask` (T, start + T) as given; (T, T) among the new tokens,
        or causal when None, each seeing every cached one (one token alone: no mask at all)."""
        if mask is not None and mask.shape[-1] == start + T:
            return AttentionMask(mask.to(device))  # it already says which cached positions each token sees
        if T == 1 and mask is None:
            return AttentionMask()
        new = torch.ones(T, T, dtype=torch.bool, device=device).tril() if mask is None else mask
        seen = torch.ones(T, start, dtype=torch.bool, device=device)
        return AttentionMask(torch.cat((seen, new.to(device)), dim=1))  # (T, start + T)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, scalar: float | None = None
    ) -> torch.Tensor:
        """q (B, H, T, D), k, v (B, Hkv, S, D) -> (B, T, H * D); each row over the last `window` keys it sees where
        given, scores scaled by 1/sqrt(`scalar`) (default D)."""
        B, _, T, _ = q.shape
        mask, causal, S = self.mask, self.causal, k.shape[2]
        if window is not None and window < S:  # else no row sees more keys than the window holds
            if mask is None:  # (a causal forward is a whole sequence: T == S)
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device)
                mask = mask.tril() if causal else mask
            mask, causal = in_window(mask, window), False
        return (
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal,
                scale=None if scalar is None else scalar**-0.5,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            .transpose(1, 2)
            .reshape(B, T, -1)
        )


@dataclass
class FixedWidthKeys:
    """Exact mode's attention layout on PyTorch's kernels, for one forward of R rows into a static cache.

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
    count: torch.Tensor  # (R,) the keys each row sees: its position + 1
    on_kernels: ClassVar[bool] = False

    @staticmethod
    def of(visible: torch.Tensor, width: int) -> FixedWidthKeys:
        """The layout of rows that see the cache slots `visible` (R, P), True where seen, P >= width."""
        count, device = visible.sum(-1), visible.device  # (R,)
        if int(count.max()) > width:
            raise ContextLengthError(
                f"exact mode attends over at most {width} keys; a token here sees {int(count.max())}"
            )
        first = (count - TAIL).clamp(min=0)[:, None]  # (R, 1) a row's first tail position
        slot = torch.arange(visible.shape[-1], device=device)
        if not (visible | (slot >= first)).all():
            raise ValueError(
                f"exact mode: a token here sees keys out of position order more than {TAIL} positions "
                f"back (a token tree more than {TAIL} deep)"
            )
        position = visible.cumsum(-1) - 1  # (R, P) of each seen slot: a row's slots hold its positions in order
        row, seen = (visible & (position >= first)).nonzero(as_tuple=True)
        tail = torch.zeros(len(count), TAIL, dtype=torch.long, device=device)
        tail[row, position[row, seen] - first[row, 0]] = seen
        keys = torch.cat((slot[:width] < first, torch.arange(TAIL, device=device) < count[:, None] - first), -1)
        bias = torch.zeros(keys.shape, device=device).masked_fill_(~keys, float("-inf"))
        last = int(visible.any(0).nonzero().max()) + 1
        return FixedWidthKeys(tail, bias[:, None], min(-(-last // 64) * 64, visible.shape[-1]), count)

    def windowed(self, window: int | None) -> torch.Tensor:
        """The bias of rows that see only their last `window` positions (None: all): the prefix key j is position j,
        the tail key i the row's position count - TAIL + i (from 0)."""
        if window is None:
            return self.bias
        W, device = self.bias.shape[-1] - TAIL, self.bias.device
        first = (self.count - TAIL).clamp(min=0)[:, None]
        positions = torch.cat(
            (torch.arange(W, device=device).expand(len(first), W), first + torch.arange(TAIL, device=device)), -1
        )
        return self.bias.masked_fill((positions < (self.count[:, None] - window))[:, None], float("-inf"))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, scalar: float | None = None
    ) -> torch.Tensor:
        """q (1, H, R, D) and the whole cache's k, v (1, Hkv, P, D) -> (1, R, H * D); each row over its last `window`
        positions where given, scores scaled by 1/sqrt(`scalar`) (default D).

        Explicit matmuls, not scaled_dot_product_attention: its float32 CPU kernel gives a row a different result
        on another thread, and which thread takes a row depends on the row's index. A score is one dot product,
        the same whatever the number of keys and wherever its key sits, so the scores are taken against the slots
        that some row sees, the tail's gathered from them, and the prefix's padded to the fixed width W. The
        softmax runs jointly over [prefix | tail] in float32; the prefix's values are used in place, in one matmul
        of width W for all rows (an unseen slot adds an exact zero: the cache is zeroed, so its values are
        finite), and each row's tail values are gathered. The three matmuls run at the chunk's fixed row count
        (`Execution.row_floor`).
        """
        _, H, R, D = q.shape
        Hkv, W, span = k.shape[1], self.bias.shape[-1] - TAIL, self.span
        G = H // Hkv
        q = q[0].view(Hkv, G, R, D).transpose(1, 2).reshape(Hkv, -1, D)  # (Hkv, R * G, D), row by row
        scale = (D if scalar is None else scalar) ** -0.5
        scores = ((q.float() * scale) @ k[0, :, :span].float().transpose(-1, -2)).view(Hkv, R, G, span)
        tail = scores.gather(-1, self.tail[None, :, None].expand(Hkv, R, scores.shape[2], TAIL))
        prefix = F.pad(scores, (0, W - span), value=float("-inf"))  # cut instead where span > W (slots > W)
        p = (torch.cat((prefix, tail), -1) + self.windowed(window)).softmax(-1).to(v.dtype)  # (Hkv, R, G, W + TAIL)
        y = (p[..., :W].reshape(Hkv, -1, W) @ v[0, :, :W]).view(Hkv, R, -1, D)  # (Hkv, R, G, D)
        y = y + p[..., W:] @ v[0].index_select(1, self.tail.flatten()).view(Hkv, R, TAIL, D)
        return y.permute(1, 0, 2, 3).reshape(1, R, H * D)


@dataclass
class VisibleSlots:
    """Attention through verispec's kernels (verispec/kernels), one sequence into a `KVCache`: each row's softmax over
    exactly the cache slots it sees, taken in slot order, the others skipped rather than masked. A row then adds the
    same numbers in the same order whether its token is decoded alone, in a chain, in a tree (whose nodes sit past
    their positions, but in position order) or in a prefill chunk, at no fixed width and with no limit on a tree's
    depth: exact mode at no cost. A forward laid out this way runs nothing but kernels, so it is captured and replayed
    (models/captured.py). `rope`: the rotary tables (cos, sin by position) its rows' are gathered from, by RoPE
    (`ModelConfig.rope`).
    """

    visible: torch.Tensor  # (R, slots) uint8, 1 where the row sees the cache slot
    rope: dict[Rope, Table] | None = None
    on_kernels: ClassVar[bool] = True

    @staticmethod
    def of(visible: torch.Tensor, rope: dict[Rope, Table] | None = None) -> VisibleSlots:
        """Rows that see the cache slots `visible` (R, slots), True where seen."""
        return VisibleSlots(visible.to(torch.uint8).contiguous(), rope)

    def store_and_attend(
        self,
        cache: KVCache,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        scalar: float | None = None,
    ) -> torch.Tensor:
        """The rows' new keys and values k, v (R, Hkv * D) into `cache`, and their queries q (H, R, D) over the slots
        each sees (the last `window` of them where given; `kernels.attend`) -> (R, H * D). The cache keeps every key,
        a sliding window's too."""
        keys, values = cache.store(layer, k, v)
        return kernels.attend(q, keys, values, self.visible, window, scalar)


def exact_layout(on_kernels: bool, visible: torch.Tensor, width: int) -> FixedWidthKeys | VisibleSlots:
    """Exact mode's layout for rows that see the cache slots `visible` (R, P), keys `width` wide: each row over its
    own slots on verispec's kernels (`on_kernels`), else over the fixed width."""
    return VisibleSlots.of(visible) if on_kernels else FixedWidthKeys.of(visible.bool(), width)


Layout = AttentionMask | FixedWidthKeys | VisibleSlots  # what the math (models/llama.py) runs over
