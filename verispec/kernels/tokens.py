"""What a decoding step does around a captured forward (kernels/tokens.cpp), so that no Python runs between forwards:
the argmax, a causal forward's positions and visible slots, a greedy chain's step to its next token; and kernel calls
put together as one program, or run inside another."""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from verispec.kernels.calls import Arg, address, call, kernel_for
from verispec.kernels.capture import Program, kernel_address


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for rows x (R, V) with a unit last stride: the first index of each row's largest value, a
    NaN counting as the largest -> (R,) int64."""
    kernel = kernel_for("argmax", x)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"argmax takes rows (R, V) with a unit last stride; got {tuple(x.shape)} strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    call(kernel, [x, x.stride(0), *x.shape, out])
    return out


def causal_rows(
    positions: torch.Tensor, visible: torch.Tensor, length: ctypes.c_int64, offset: int = 0
) -> tuple[str, list[Arg]]:
    """A causal forward's inputs, written when the call runs: row r of R at position length.value + offset + r in
    `positions` (int64 (R,)), seeing the slots up to its own in `visible` (uint8 (R, S)); a row past the S slots
    fails the program. Returns the call, checked, for a `program`."""
    if (
        positions.dtype != torch.int64
        or positions.dim() != 1
        or not positions.is_contiguous()
        or visible.dtype != torch.uint8
        or visible.dim() != 2
        or not visible.is_contiguous()
        or len(visible) != len(positions)
    ):
        raise ValueError(
            f"causal_rows: positions int64 (R,) and visible uint8 (R, S), contiguous; got "
            f"{positions.dtype} {tuple(positions.shape)} and {visible.dtype} {tuple(visible.shape)}"
        )
    return "causal_rows", [positions, visible, visible.shape[1], len(positions), length, offset]


def next_token(
    logits: torch.Tensor,
    out: torch.Tensor,
    i: int,
    token: torch.Tensor,
    position: torch.Tensor,
    visible: torch.Tensor,
    length: ctypes.c_int64,
    stored: int,
    ids: torch.Tensor | None = None,
) -> tuple[str, list[Arg]]:
    """A greedy chain's step, after a forward that stored `stored` tokens from slot length.value on: the argmax of
    `logits` (V,) (`ids[argmax]` where they are logits over the tokens `ids`, int64 (V,)) becomes out[i] and `token`
    (the next forward's input, one int64) at `position` + 1, which sees the slots up to its own (`visible`, uint8
    (S,)), and the length grows by `stored`; all read and written when the call runs. Returns the call, checked, for
    a `program`."""
    kernel = kernel_for("next_token", logits)
    if (
        logits.dim() != 1
        or logits.stride(0) != 1
        or visible.dim() != 1
        or visible.dtype != torch.uint8
        or any(t.dtype != torch.int64 or not t.is_contiguous() for t in (out, token, position))
        or not 0 <= i < len(out)
    ):
        raise ValueError(
            f"next_token: logits (V,), out int64 (n,) with i < n, token and position int64, visible "
            f"uint8 (S,); got {tuple(logits.shape)}, {tuple(out.shape)} with i = {i}, {visible.dtype}"
        )
    if ids is not None and (ids.dtype != torch.int64 or ids.shape != logits.shape or not ids.is_contiguous()):
        raise ValueError(
            f"next_token: ids int64 ({len(logits)},) for logits over them; got {ids.dtype} {tuple(ids.shape)}"
        )
    return kernel, [logits, len(logits), out, i, token, position, visible, length, len(visible), stored, ids]


def run(program: Program) -> tuple[str, list[Arg]]:
    """A call that runs `program` inside another (kept alive by the caller as long as the other runs)."""
    return "run", [program.code, program.calls]


def program(calls: Sequence[tuple[str, Sequence[Arg]]]) -> Program:
    """Kernel calls, each (name, arguments), as one program, without running them: a chain of captured forwards."""
    return Program([(kernel_address(name), [address(arg) for arg in args]) for name, args in calls])
