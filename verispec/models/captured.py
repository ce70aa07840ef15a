"""A forward on verispec's kernels, captured once per shape and replayed without Python (kernels/capture.py).

On the kernels (`KeyRows` attention: one sequence into a `KVCache`) a forward is nothing but kernel calls on views
of the tensors they write, so it can be recorded while it runs and replayed as one C call, as CUDA graphs are on a
GPU. What changes between two forwards of one shape is copied into the tensors the capture read: the tokens, their
positions and which cache slots each row sees. The cache is the one a forward names: the program's pointers into
the capture's cache (its keys, its values, its length, which the kernels read when they run) are rewritten to the
cache at hand before a replay, so a capture serves every cache of its layout, one generation after another.

Captures are kept by the model (`LlamaForCausalLM.captured`), keyed by the row count, the blocks run, the states
asked for and the cache's layout; each holds the intermediate tensors of its forward, so only forwards of at most
`MAX_ROWS` rows are captured (a long prompt's prefill, seen once, is not worth keeping). A forward that computes
anything outside the kernels cannot be captured (`NotCapturable`); it then runs as it is, op by op. A capture's
buffers are shared by every cache, so its replays are serialised (a lock).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import TYPE_CHECKING, Sequence

import torch

from verispec import kernels
from verispec.kernels.capture import NotCapturable

if TYPE_CHECKING:
    from verispec.models.cache import KVCache
    from verispec.models.llama import KeyRows, LlamaForCausalLM

MAX_ROWS = 64  # the most rows a captured forward takes: chains, trees, exact mode's 16-row prefill chunks
Outputs = tuple[torch.Tensor, list[torch.Tensor]]  # logits (1, T, V) and the hidden states asked for


class CapturedForward:
    """One forward's kernel calls, recorded while it ran into `cache` with these inputs' shapes."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, run: Sequence[int], hidden: Sequence[int],
                 tokens: torch.Tensor, positions: torch.Tensor, rows: KeyRows) -> None:
        from verispec.models.llama import KeyRows  # here: llama.py imports this module

        self.tokens, self.positions, self.visible = tokens.clone(), positions.clone(), rows.visible.clone()
        with kernels.capturing() as capture:
            self.logits, self.states = model._layers(self.tokens, self.positions, cache, KeyRows(self.visible), run,
                                                     hidden)
        self.program = capture.program()
        self.lock = threading.Lock()
        # Pointers into the cache, as (place in the program, which part, offset): rewritten for another cache
        self.into_cache: list[tuple[int, str, int]] = []
        self.keep = []  # what the other pointers point into, alive as long as the program
        for call, argument, target in capture.pointers:
            part = _part_of(cache, target)
            if part is None:
                self.keep.append(target)
            else:
                base = _address(cache._length if part == "length" else getattr(cache, part))
                address = _address(target)
                self.into_cache.append((self.program.word(call, argument), part, address - base))
        self.words = torch.tensor([word for word, *_ in self.into_cache], dtype=torch.int64)
        self.bound = weakref.ref(cache)

    def __call__(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, rows: KeyRows) -> Outputs:
        if positions.shape != self.positions.shape or rows.visible.shape != self.visible.shape:
            raise ValueError(f"positions {tuple(positions.shape)} and visible slots {tuple(rows.visible.shape)} for "
                             f"{self.tokens.shape[1]} tokens into a cache of {self.visible.shape[1]} slots")
        with self.lock:
            if self.bound() is not cache:
                self._bind(cache)
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)
            self.visible.copy_(rows.visible)
            self.program()
            return self.outputs()

    def _bind(self, cache: KVCache) -> None:
        """Point the program's cache arguments at `cache`."""
        bases = {"k": cache.k.data_ptr(), "v": cache.v.data_ptr(), "length": ctypes.addressof(cache._length)}
        self.program.code[self.words] = torch.tensor([bases[part] + offset for _, part, offset in self.into_cache],
                                                     dtype=torch.int64)
        self.bound = weakref.ref(cache)

    def outputs(self) -> Outputs:
        """Copies of the outputs: the next replay overwrites them."""
        return self.logits.clone(), [state.clone() for state in self.states]


def _address(target: object) -> int:
    return target.data_ptr() if isinstance(target, torch.Tensor) else ctypes.addressof(target)


def _part_of(cache: KVCache, target: object) -> str | None:
    """Which part of `cache` a pointer argument points into: "k", "v", "length", or None (elsewhere)."""
    if target is cache._length:
        return "length"
    if isinstance(target, torch.Tensor):
        storage = target.untyped_storage().data_ptr()
        for part in ("k", "v"):
            if storage == getattr(cache, part).untyped_storage().data_ptr():
                return part
    return None


def replay(model: LlamaForCausalLM, cache: KVCache, blocks: tuple[tuple[int, ...], tuple[int, ...]],
           tokens: torch.Tensor, positions: torch.Tensor, rows: KeyRows) -> Outputs:
    """The forward of `tokens` (1, T) at `positions` (T,) seeing `rows`, running blocks[0] and returning the states
    blocks[1]: replayed from the model's capture for this shape, captured first if there is none."""
    run, hidden = blocks
    if positions.dim() != 1 or positions.dtype != torch.int64:
        positions = positions.reshape(-1).to(torch.int64)
    T = tokens.shape[1]
    key = (T, run, hidden, tuple(cache.k.shape), cache.k.dtype)
    captured = model.captured.get(key, False)
    if captured is False and T <= MAX_ROWS:
        try:
            captured = CapturedForward(model, cache, run, hidden, tokens, positions, rows)
        except NotCapturable:
            model.captured[key] = None  # runs op by op from now on
        else:
            model.captured[key] = captured
            return captured.outputs()
    if not captured:
        return model._layers(tokens, positions.contiguous(), cache, rows, run, hidden)
    return captured(cache, tokens, positions, rows)
