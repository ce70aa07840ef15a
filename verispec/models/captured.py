"""A forward on verispec's kernels, captured once per shape and replayed without Python (kernels/capture.py).

On the kernels (`VisibleSlots` attention: one sequence into a `KVCache`) a forward is nothing but kernel calls on views
of the tensors they write, so it can be recorded while it runs and replayed as one C call, as CUDA graphs are on a
GPU. What changes between two forwards of one shape is copied into the tensors the capture read: the tokens, their
positions and which cache slots each row sees (for a causal forward, a kernel at the head of the program writes the
last two from the cache's length: `replay_causal`). The cache is the one a forward names: the program's pointers into
the capture's cache (its keys, its values, its length, which the kernels read when they run) are rewritten to the
cache at hand before a replay, so a capture serves every cache of its layout, one generation after another.

Captures are kept by the forward's runner (`Execution.captured`, `PackedEagleHead.captured`), keyed by the row count,
the cache's layout (a cache without rows allocates its slots in blocks, so that nearby sizes share one) and whatever
else changes the calls (the blocks run, the states asked for). Each holds the intermediate tensors of its forward, so
only forwards of at most `MAX_ROWS` rows are captured: at once up to `EAGER_ROWS` (decoding's shapes), and past it when
a shape comes a second time (a large token tree comes again). A prompt's prefill is captured only when its shape comes
a second time (capturing costs more than running op by op once, and a prompt's length seldom comes again), and never
past `EAGER_ROWS`: a prompt of that length comes again only as the same prompt asked again (a bench's methods in turn),
and its capture would take a large share of `MAX_HELD_ROWS` from the decoding shapes, each then captured again. A
model's captures hold at most `MAX_HELD_ROWS` rows together, the least recently used dropped first. A forward that
computes anything outside the kernels cannot be captured (`NotCapturable`); it then runs as it is, op by op. A
capture's buffers are shared by every cache, so its replays are serialised (a lock).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import replace
from typing import Callable, Hashable, Sequence

import torch

from verispec import kernels
from verispec.kernels.capture import NotCapturable
from verispec.models.cache import KVCache
from verispec.models.layout import VisibleSlots

MAX_ROWS = 64  # the most rows a captured forward takes: chains, trees, short prefills
EAGER_ROWS = 16  # forwards of at most this many rows are captured the first time their shape runs
MAX_HELD_ROWS = 256  # the most rows a model's captures hold together (each row's intermediates)
Outputs = tuple[torch.Tensor, list[torch.Tensor]]  # e.g. logits (1, T, V) and the hidden states asked for


class CapturedForward:
    """One forward's kernel calls, recorded while `forward(*inputs, rows)` ran into `cache`."""

    def __init__(
        self, forward: Callable[..., Outputs], cache: KVCache, inputs: Sequence[torch.Tensor], rows: VisibleSlots
    ) -> None:
        self.inputs, self.visible = [x.clone() for x in inputs], rows.visible.clone()
        self.rows = len(self.visible)
        with kernels.capturing() as capture:
            self.out, self.states = forward(*self.inputs, replace(rows, visible=self.visible))
        self.program = capture.program()
        self.lock = threading.Lock()
        # Pointers into the cache, as (place in the program, which part, offset): rewritten for another cache
        self.into_cache: list[tuple[int, str, int]] = []
        self.keep = []  # what the other pointers point into, alive as long as the program
        bases = _bases(cache)
        for call, argument, target in capture.pointers:
            part = cache.part_of(target)
            if part is None:
                self.keep.append(target)
            else:
                self.into_cache.append((self.program.word(call, argument), part, kernels.address(target) - bases[part]))
        self.words = torch.tensor([word for word, *_ in self.into_cache], dtype=torch.int64)
        self.bound, self.bases = weakref.ref(cache), bases
        # Programs that run this one with calls around it (`replay_causal`, `replay_chain`), for the bound cache
        self.made: dict[Hashable, tuple] = {}

    def __call__(self, cache: KVCache, inputs: Sequence[torch.Tensor], rows: VisibleSlots) -> Outputs:
        with self.lock:
            self.load(cache, inputs, rows)
            self.program()
            return self.outputs()

    def load(self, cache: KVCache, inputs: Sequence[torch.Tensor], rows: VisibleSlots) -> None:
        """Point the program at `cache` and copy the inputs into the capture's buffers (its lock held)."""
        shapes = [tuple(x.shape) for x in (*inputs, rows.visible)]
        if shapes != [tuple(x.shape) for x in (*self.inputs, self.visible)]:
            raise ValueError(
                f"inputs of {shapes[:-1]} and visible slots {shapes[-1]} for a forward captured with "
                f"{[tuple(x.shape) for x in self.inputs]} into a cache of {self.visible.shape[1]} slots"
            )
        self.bind(cache)
        for buffer, x in zip(self.inputs, inputs):
            buffer.copy_(x)
        self.visible.copy_(rows.visible)

    def bind(self, cache: KVCache) -> None:
        """Point the program's cache arguments at `cache` (its lock held); the programs made for another go."""
        bases = _bases(cache)
        if self.bound() is cache and bases == self.bases:  # (a cache that grew has new keys and values)
            return
        self.program.code[self.words] = torch.tensor(
            [bases[part] + offset for _, part, offset in self.into_cache], dtype=torch.int64
        )
        self.bound, self.bases = weakref.ref(cache), bases
        self.made.clear()

    def outputs(self) -> Outputs:
        """Copies of the outputs: the next replay overwrites them."""
        return self.out.clone(), [state.clone() for state in self.states]


def _make_room(captured: dict, rows: int) -> None:
    """Drop the least recently used captures until `rows` more fit under MAX_HELD_ROWS (a replay in progress keeps
    its own). Under `_BOOKS`."""
    held = [(key, capture.rows) for key, capture in captured.items() if isinstance(capture, CapturedForward)]
    total = sum(n for _, n in held)
    for key, n in held:
        if total + rows <= MAX_HELD_ROWS:
            break
        captured.pop(key, None)
        total -= n


def _bases(cache: KVCache) -> dict[str, int]:
    """Where each part of `cache` that a program may point into starts."""
    return {part: kernels.address(place) for part, place in cache.storage().items()}


ONCE, REFUSED = "run once", "not capturable"  # what `captured` holds for a shape run op by op once, or for good
_BOOKS = threading.Lock()  # held while a captures' dict is read or changed (not while a forward runs): any thread


def replay(
    captured: dict,
    key: Hashable,
    cache: KVCache,
    forward: Callable[..., Outputs],
    inputs: Sequence[torch.Tensor],
    rows: VisibleSlots,
    prefill: bool = False,
) -> Outputs:
    """`forward(*inputs, rows)` (a forward of T = len(rows.visible) rows into `cache`, nothing but verispec's
    kernels): replayed from `captured[key]`, captured there first (see the module's notes on when). `key` names the
    forward's shape: its row count, the cache's layout and whatever else changes the kernel calls it makes.
    `prefill`: a prompt's forward (logits of its last row only): captured only when its shape comes again (a
    prompt's length seldom does: capturing it would only slow the first token), and never past EAGER_ROWS rows.
    `captured` is kept in order of use, the least recent first."""
    R = rows.visible.shape[0]
    with _BOOKS:
        state = captured.pop(key, None)
        capture_now = state == ONCE or state is None and R <= EAGER_ROWS and not prefill
        if state is None and not capture_now and R <= (EAGER_ROWS if prefill else MAX_ROWS):
            state = ONCE  # captured if it comes again
        if capture_now:
            _make_room(captured, R)
        elif state is not None:
            captured[key] = state
    if capture_now:
        try:
            state = CapturedForward(forward, cache, inputs, rows)
            out = state.outputs()  # before another thread can find it and replay over them
        except NotCapturable:
            state = REFUSED
        with _BOOKS:
            captured[key] = state
        if state is not REFUSED:
            return out
    if isinstance(state, CapturedForward):
        return state(cache, inputs, rows)
    return forward(*inputs, rows)


def lookup(captured: dict, key: Hashable) -> CapturedForward | None:
    """The capture of shape `key`, marked as just used, or None."""
    with _BOOKS:
        state = captured.get(key)
        if not isinstance(state, CapturedForward):
            return None
        captured[key] = captured.pop(key)
        return state


def replay_causal(capture: CapturedForward, cache: KVCache, tokens: torch.Tensor) -> Outputs:
    """`capture`, a forward whose inputs are tokens (1, T) and their positions (T,), replayed as a causal forward of
    `tokens` after the cache's length: each row at the next position, seeing every slot before it and its own. A
    kernel writes the positions and visible slots from the cache's length as the program runs, so that only the
    tokens are copied in: a decoding step's forward with next to no Python."""
    if tokens.shape != capture.inputs[0].shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} for a forward captured with {tuple(capture.inputs[0].shape)}")
    with capture.lock:
        capture.bind(cache)
        program = capture.made.get("causal")
        if program is None:
            positions = capture.inputs[1]
            program = capture.made["causal"] = kernels.program(
                [kernels.causal_rows(positions, capture.visible, cache.length_cell), kernels.run(capture.program)]
            )
        capture.inputs[0].copy_(tokens)
        program()
        return capture.outputs()


def replay_chain(
    first: CapturedForward,
    step: CapturedForward,
    cache: KVCache,
    tokens: torch.Tensor,
    n: int,
    vocab: int,
    ids: torch.Tensor | None = None,
) -> list[int]:
    """n tokens of greedy decoding as one program: `first` (a captured causal forward of the new `tokens` (1, T),
    its logits at the last of them), then n - 1 replays of `step` (a captured one-token forward; `first` itself when
    T is 1), each forward's argmax made the next one's input by `kernels.next_token`. Both take tokens and positions
    as `replay_causal`'s do, and their positions and visible slots are written from the cache's length as the
    program runs. The two captures' programs run inside the chain's, with no Python between them, and no capture of
    its own is made. `ids`: the tokens the logits are over (an LM head over part of the vocabulary), else token i's
    logits are its row i. (A failure leaves the cache part-advanced: the caller rolls it back.)"""
    T = tokens.shape[1]
    if tokens.shape != first.inputs[0].shape or step.inputs[0].shape != (1, 1):
        raise ValueError(
            f"tokens {tuple(tokens.shape)} for a chain from a forward captured with "
            f"{tuple(first.inputs[0].shape)}, then one of {tuple(step.inputs[0].shape)}"
        )
    following = None if step is first else step  # (not `first` itself: no reference cycle)
    with first.lock, step.lock if step is not first else contextlib.nullcontext():
        first.bind(cache)
        step.bind(cache)
        made = first.made.get(("chain", n, vocab))
        if made is None or made[0] is not following:
            token, position = step.inputs
            out = torch.empty(n, dtype=torch.int64)
            calls = [kernels.causal_rows(first.inputs[1], first.visible, cache.length_cell)]
            if step is not first:  # its first run follows the last of `tokens` (`next_token` moves it on)
                calls.append(kernels.causal_rows(position, step.visible, cache.length_cell, T - 1))
            calls.append(kernels.run(first.program))
            for i in range(n):
                logits = (first if i == 0 else step).out[0, -1, :vocab]
                calls.append(
                    kernels.next_token(
                        logits, out, i, token[0], position, step.visible[0], cache.length_cell, T if i == 0 else 1, ids
                    )
                )
                if i < n - 1:
                    calls.append(kernels.run(step.program))
            made = first.made[("chain", n, vocab)] = (following, kernels.program(calls), out, ids)  # (ids alive)
        _, chain, out, _ = made
        first.inputs[0].copy_(tokens)
        chain()
        return out.tolist()
