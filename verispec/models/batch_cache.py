"""A KV cache for several sequences at once: a slot per sequence, each slot with its own length."""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from verispec.errors import ContextLengthError
from verispec.models.cache import saturate_f16


class BatchKVCache:
    """Keys and values of `slots` sequences, preallocated to `max_len` positions each.

    `lengths[s]` is the number of positions slot s holds. A forward over some slots (`layout`) writes each row's real
    tokens at its own offset and advances only that row's length by its real tokens; rolling a slot back is
    `truncate(slot, length)`, which moves that slot's length alone. Zero-initialised: a row of a batched forward
    reads keys up to the longest row's end, past its own length (masked), and 0 * NaN from uninitialised memory
    would leak through the attention's weighted sum.
    """

    exact: ClassVar[bool] = False  # padded batches through PyTorch's attention: a row's bits depend on its batch

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_len, self.lengths = max_len, [0] * slots
        self.bytes_per_position = layers * kv_heads * head_dim * 2 * dtype.itemsize
        self.k = torch.zeros(layers, slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        """The bytes its keys and values hold: all of them, from the start."""
        return self.k.nbytes + self.v.nbytes

    def open(self, slot: int, max_len: int) -> None:
        """A sequence of at most `max_len` positions takes slot `slot` (its room is there already)."""
        if not 1 <= max_len <= self.max_len:
            raise ValueError(f"{max_len} positions is not within 1 .. {self.max_len}")

    def truncate(self, slot: int, length: int) -> int:
        """Roll slot `slot` back to `length` positions (O(1)); returns how many were removed. Other slots are
        untouched."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        removed, self.lengths[slot] = self.lengths[slot] - length, length
        return removed

    def layout(self, slots: Sequence[int], counts: Sequence[int], width: int) -> BatchLayout:
        """The layout of one forward of `width` tokens per row over `slots`, row b holding counts[b] real tokens
        (the rest is padding)."""
        return BatchLayout(self, list(slots), list(counts), width)


class BatchLayout:
    """One batched forward's layout: where each row's tokens go, which keys each sees, their rotary positions.

    Row b continues slot slots[b] from its length; its first counts[b] tokens are real, the rest padding. A real
    token sees its slot's cached keys and the row's real tokens up to itself; a padding token sees what the row's
    last real token sees (so no row is masked out entirely); padding is never written to the cache.
    """

    on_kernels: ClassVar[bool] = False  # padded rows through PyTorch's attention

    def __init__(self, cache: BatchKVCache, slots: list[int], counts: list[int], width: int) -> None:
        device = cache.k.device
        starts = [cache.lengths[s] for s in slots]
        for slot, start, count in zip(slots, starts, counts):
            if not 1 <= count <= width:
                raise ValueError(f"slot {slot}: a row holds 1 to {width} real tokens, not {count}")
            if start + count > cache.max_len:
                raise ContextLengthError(
                    f"KV cache slot {slot} holds {cache.max_len} positions; {start} used, {count} more asked"
                )
        self.cache, self.slots, self.counts = cache, slots, counts
        start, count = torch.tensor(starts, device=device)[:, None], torch.tensor(counts, device=device)[:, None]
        steps = torch.arange(width, device=device)
        self.positions = start + steps  # (B, T): rotary positions, padding's included (it needs some)
        self.span = max(s + c for s, c in zip(starts, counts))  # keys any real token sees lie below this
        sees_up_to = start + torch.minimum(steps, count - 1)  # (B, T) the last key position each token sees
        self.mask = (torch.arange(self.span, device=device) <= sees_up_to[..., None])[:, None]  # (B, 1, T, S)
        self.real = steps < count  # (B, T)
        index = torch.tensor(slots, device=device)
        self.write_slot, self.write_position = index[:, None].expand_as(self.real)[self.real], self.positions[self.real]
        first = slots[0]
        self.block = slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None
        self.index = index

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new (B, Hkv, T, D) keys and values (real tokens only); return the rows' keys and
        values (B, Hkv, span, D)."""
        keys, values = self.cache.k[layer], self.cache.v[layer]  # (slots, Hkv, max_len, D)
        keys[self.write_slot, :, self.write_position] = saturate_f16(k.transpose(1, 2)[self.real], keys).to(keys.dtype)
        values[self.write_slot, :, self.write_position] = saturate_f16(v.transpose(1, 2)[self.real], values).to(
            values.dtype
        )
        if self.block is not None:  # neighbouring slots: a view, no copy
            return keys[self.block, :, : self.span], values[self.block, :, : self.span]
        keys, values = keys[:, :, : self.span], values[:, :, : self.span]
        return keys.index_select(0, self.index), values.index_select(0, self.index)

    def advance(self) -> None:
        """After the forward: each slot holds its row's real tokens."""
        for slot, count in zip(self.slots, self.counts):
            self.cache.lengths[slot] += count
