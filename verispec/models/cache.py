"""A preallocated key/value cache that owns its length and rolls back in O(1)."""

from __future__ import annotations

import ctypes

import torch

from verispec import kernels
from verispec.errors import ContextLengthError

SLOT_BLOCK = 128  # a cache without rows allocates its slots in blocks of this many: caches of nearby sizes then share
# a layout, and with it the forwards captured for it (models/captured.py)
FIRST_SLOTS = 1024  # what a cache without rows holds at first; it doubles as its tokens need, up to max_len (so that
# memory follows the tokens used, not the model's context, and a cache passes through few layouts on its way)


F16_MAX = 65504.0  # float16's largest finite value


def in_blocks(n: int) -> int:
    """n positions rounded up to whole blocks of SLOT_BLOCK."""
    return -(-n // SLOT_BLOCK) * SLOT_BLOCK


def saturate_f16(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as a float16 `cache` stores it: into float16's finite range (NaN stays NaN), as verispec's store_kv_f16
    does, so that a slot never holds an infinity; x itself for a cache of another dtype."""
    return x.clamp(-F16_MAX, F16_MAX) if cache.dtype == torch.float16 and x.dtype != torch.float16 else x


class KVCache:
    """Keys and values of every layer, for up to `max_len` positions.

    `length` is the number of positions filled. A forward writes its new positions at
    [length, length + T) and then `advance`s; rejecting drafted tokens is `truncate`, which only
    moves `length` back: stale entries past it are never read and are overwritten later.
    A growing cache (by default one without rows) holds FIRST_SLOTS slots at first (or its capacity's, if fewer) and
    doubles them when a forward needs more (`reserve`), up to its capacity: its memory follows the tokens it holds.
    """

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        rows: int | None = None,
        width: int | None = None,
        grows: bool | None = None,
    ) -> None:
        self._length = ctypes.c_int64(0)  # where verispec's kernels read it when a captured forward is replayed
        self.max_len, self.rows = max_len, rows
        # An exact-mode cache (`rows` set) holds `rows` slots more than max_len for a forward's padding rows, and
        # `width` (default max_len + rows) at least: the keys every row attends over on PyTorch's kernels, which read
        # every slot (a static cache: all of them at once, zeroed). On verispec's they read only the slots a row
        # sees, so there it grows (`grows`) as any other.
        self.width = max_len + rows if rows is not None and width is None else width
        self.grows = rows is None if grows is None else grows
        self.capacity = in_blocks(max_len) if self.grows else max(max_len + rows, self.width)
        shape = (layers, batch, kv_heads, min(self.capacity, FIRST_SLOTS) if self.grows else self.capacity, head_dim)
        if self.grows:
            # Uninitialised: attention only ever reads positions below `length`, which were written first.
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        else:
            # Zeros: a static cache's attention reads every slot, masked or not, and 0 * NaN would leak through.
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        """The positions its keys and values hold room for now."""
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """The bytes its keys and values hold now."""
        return self.k.nbytes + self.v.nbytes

    @property
    def length(self) -> int:
        """The positions filled."""
        return self._length.value

    @length.setter
    def length(self, n: int) -> None:
        self._length.value = n

    @property
    def length_cell(self) -> ctypes.c_int64:
        """Where the length lives: kernels read it (and a chain's write it) as they run, a captured one's included."""
        return self._length

    def storage(self) -> dict[str, torch.Tensor | ctypes.c_int64]:
        """What a captured forward's program may point into, by part: the keys, the values and the length cell. A
        replay into this cache rewrites the program's pointers to these places (models/captured.py)."""
        return {"k": self.k, "v": self.v, "length": self._length}

    def part_of(self, target: object) -> str | None:
        """Which part of `storage()` a kernel's pointer argument `target` points into: "k", "v", "length", or None
        (elsewhere)."""
        if target is self._length:
            return "length"
        if isinstance(target, torch.Tensor):
            storage = target.untyped_storage().data_ptr()
            for part in ("k", "v"):
                if storage == getattr(self, part).untyped_storage().data_ptr():
                    return part
        return None

    def reserve(self, n: int) -> None:
        """Check that `n` more positions fit, and make room for them, before any layer writes them."""
        if self.length + n > self.max_len:
            raise ContextLengthError(f"KV cache holds {self.max_len} positions; {self.length} used, {n} more asked")
        if self.length + n > self.slots and self.grows:
            self._grow(self.length + n)

    def _grow(self, need: int) -> None:
        """Twice the slots (or what `need` takes, in blocks), up to the capacity; the filled positions copied over.
        The keys and values are new tensors: a captured forward bound to this cache is bound again before it runs
        (models/captured.py), and its shape is another capture's."""
        layers, batch, kv_heads, _, head_dim = self.k.shape
        slots = min(self.capacity, max(2 * self.slots, in_blocks(need)))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(layers, batch, kv_heads, slots, head_dim, dtype=old.dtype, device=old.device)
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new (B, Hkv, T, D) keys and values; return all keys and values so far (in a static
        cache, all its slots)."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = saturate_f16(k, self.k)
        self.v[layer, :, :, self.length : end] = saturate_f16(v, self.v)
        if not self.grows:  # static: every slot, for a fixed key width
            return self.k[layer], self.v[layer]
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for one sequence by verispec's kernels: k, v (T, Hkv * D) rows (views of a projection's output)
        into slots length .. length + T - 1, the length read when the kernel runs (a captured forward's replay
        included); returns every slot's keys and values (Hkv, slots, D)."""
        keys, values = self.k[layer, 0], self.v[layer, 0]
        kernels.store_kv(k, v, keys, values, self._length)
        return keys, values

    def advance(self, n: int) -> None:
        self.length += n

    def keep(self, start: int, offsets: list[int]) -> None:
        """Move the entries at start + offsets[j] to start + j and truncate after them: a token tree's
        accepted path, compacted into place once verified."""
        if offsets != list(range(len(offsets))):  # a chain prefix is already in place
            src = torch.tensor(offsets, device=self.k.device) + start
            end = start + len(offsets)
            self.k[:, :, :, start:end] = self.k[:, :, :, src]  # the gather copies before the write
            self.v[:, :, :, start:end] = self.v[:, :, :, src]
        self.truncate(start + len(offsets))

    def truncate(self, length: int) -> int:
        """Roll back to `length` positions (O(1)); returns how many were removed."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        removed, self.length = self.length - length, length
        return removed
