"""A forward on verispec's kernels, captured once per shape and replayed without Python (kernels/capture.py).

On the kernels (`KeyRows` attention: one sequence into a `KVCache`) a forward is nothing but kernel calls on views
of the tensors they write, so it can be recorded while it runs and replayed as one C call, as CUDA graphs are on a
GPU. What changes between two forwards of one shape into one cache is copied into the tensors the capture read: the
tokens, their positions and which cache slots each row sees; the cache's length is read by the kernels themselves
when they run. A capture is kept in the cache it writes (`cache.captured`), keyed by the model, the row count, the
blocks run and the states asked for, and dies with it. A forward that computes anything outside the kernels cannot
be captured (`NotCapturable`); it then runs as it is, op by op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from verispec import kernels
from verispec.kernels.capture import NotCapturable

if TYPE_CHECKING:
    from verispec.models.cache import KVCache
    from verispec.models.llama import KeyRows, LlamaForCausalLM

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

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, rows: KeyRows) -> Outputs:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.visible.copy_(rows.visible)
        self.program()
        return self.outputs()

    def outputs(self) -> Outputs:
        """Copies of the outputs: the next replay overwrites them."""
        return self.logits.clone(), [state.clone() for state in self.states]


def replay(model: LlamaForCausalLM, cache: KVCache, blocks: tuple[tuple[int, ...], tuple[int, ...]],
           tokens: torch.Tensor, positions: torch.Tensor, rows: KeyRows) -> Outputs:
    """The forward of `tokens` (1, T) at `positions` (T,) seeing `rows`, running blocks[0] and returning the states
    blocks[1]: replayed from the capture for this shape in `cache`, captured first if there is none."""
    run, hidden = blocks
    if positions.dim() != 1 or positions.dtype != torch.int64:
        positions = positions.reshape(-1).to(torch.int64)
    key = (model, tokens.shape[1], run, hidden)
    captured = cache.captured.get(key)
    if key not in cache.captured:
        try:
            captured = CapturedForward(model, cache, run, hidden, tokens, positions, rows)
        except NotCapturable:
            cache.captured[key] = None  # runs op by op from now on
        else:
            cache.captured[key] = captured
            return captured.outputs()
    if captured is None:
        return model._layers(tokens, positions.contiguous(), cache, rows, run, hidden)
    return captured(tokens, positions, rows)
