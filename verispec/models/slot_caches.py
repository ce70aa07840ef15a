"""The batched engine's cache on verispec's kernels: a `KVCache` of its own for each sequence (slot), made when the slot
is first used, growing as its tokens need, and freed when the slot is emptied.

A batched forward on these caches (`SlotsLayout`) runs every row of every sequence through the same matmuls, which
give a row the same bits whatever rows share them, and attends each sequence's rows over its own cache alone, as
`generate` does: so each row's logits are bitwise what its sequence gets decoded alone (exact by construction, with
no padding and nothing read past a sequence's own keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch

from verispec import kernels
from verispec.models.cache import KVCache
from verispec.models.layout import Rope, Table, visible_slots


class SlotCaches:
    """Up to `slots` sequences' caches, at most `max_len` positions each, as `BatchKVCache` offers them (`lengths`,
    `truncate`, `layout`); `new(max_len)` makes one sequence's cache, whose positions take `bytes_per_position`."""

    exact: ClassVar[bool] = True  # a batched forward gives each sequence the bits it gets alone

    def __init__(self, slots: int, max_len: int, new: Callable[[int], KVCache], bytes_per_position: int) -> None:
        self.max_len, self._new, self.bytes_per_position = max_len, new, bytes_per_position
        self.caches: list[KVCache | None] = [None] * slots

    def open(self, slot: int, max_len: int) -> None:
        """Give slot `slot` (empty) a cache of at most `max_len` positions (what its sequence reserved)."""
        if self.caches[slot] is not None or not 1 <= max_len <= self.max_len:
            raise ValueError(f"slot {slot} is in use, or {max_len} positions is not within 1 .. {self.max_len}")
        self.caches[slot] = self._new(max_len)

    @property
    def lengths(self) -> list[int]:
        """Each slot's positions filled (0 for an empty slot)."""
        return [0 if cache is None else cache.length for cache in self.caches]

    @property
    def nbytes(self) -> int:
        """The bytes that the slots' keys and values hold now."""
        return sum(cache.nbytes for cache in self.caches if cache is not None)

    def cache(self, slot: int) -> KVCache:
        """Slot `slot`'s cache, made (of `max_len` positions) where it was not opened."""
        if self.caches[slot] is None:
            self.caches[slot] = self._new(self.max_len)
        return self.caches[slot]

    def truncate(self, slot: int, length: int) -> int:
        """Roll slot `slot` back to `length` positions; returns how many were removed. Emptied, it frees its memory."""
        cache = self.caches[slot]
        removed = 0 if cache is None else cache.truncate(length)
        if length == 0:
            self.caches[slot] = None
        return removed

    def layout(self, slots: Sequence[int], counts: Sequence[int], width: int) -> SlotsLayout:
        """The layout of one forward of `width` tokens per row over `slots`, row b holding counts[b] real tokens."""
        return SlotsLayout.of(self, list(slots), list(counts), width)


@dataclass
class SlotsLayout:
    """One batched forward on verispec's kernels: the rows' real tokens, one sequence after another, each sequence's
    over its own cache (`segments`: its cache, its first row among the real ones, its row count, the cache slots each
    row sees). Padding is left out: it is neither computed nor stored."""

    segments: list[tuple[KVCache, int, int, torch.Tensor]]
    real: torch.Tensor  # (B, width) bool: which of the padded rows' tokens are real
    positions: torch.Tensor  # (real rows,) int64: each real token's position
    slots: int  # the most slots any of the caches holds (the rotary table must cover them)
    rope: dict[Rope, Table] | None = None  # the rotary tables by RoPE (`VisibleSlots.rope`)
    on_kernels: ClassVar[bool] = True

    @staticmethod
    def of(caches: SlotCaches, slots: list[int], counts: list[int], width: int) -> SlotsLayout:
        segments, positions, first = [], [], 0
        for slot, count in zip(slots, counts):
            if not 1 <= count <= width:
                raise ValueError(f"slot {slot}: a row holds 1 to {width} real tokens, not {count}")
            cache = caches.cache(slot)
            cache.reserve(count)  # (a ContextLengthError where they do not fit)
            visible = visible_slots(None, count, cache.length, cache.slots, torch.uint8, cache.k.device)
            segments.append((cache, first, count, visible))
            positions.append(torch.arange(cache.length, cache.length + count))
            first += count
        real = torch.arange(width)[None] < torch.tensor(counts)[:, None]
        return SlotsLayout(segments, real, torch.cat(positions), max(c.slots for c, *_ in segments))

    def store_and_attend(
        self,
        cache: None,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        scalar: float | None = None,
    ) -> torch.Tensor:
        """Each sequence's new keys and values k, v (rows, Hkv * D) into its own cache, and its queries q (H, rows, D)
        over its own keys (`VisibleSlots.store_and_attend`) -> (rows, H * D)."""
        out = []
        for sequence_cache, first, count, visible in self.segments:
            keys, values = sequence_cache.store(layer, k[first : first + count], v[first : first + count])
            out.append(kernels.attend(q[:, first : first + count], keys, values, visible, window, scalar))
        return torch.cat(out)

    def advance(self) -> None:
        """After the forward: each sequence's cache holds its real tokens."""
        for cache, _, count, _ in self.segments:
            cache.advance(count)
