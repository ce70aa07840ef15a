"""Prepacked, fused linear layers for the CPU: what `load_model(..., fast=True)` puts beside a model's projections.

At batch one a forward reads every weight once and does little else, so its time is the matmul kernels' read
speed. Eager `F.linear` reads a plain row-major weight below the memory's rate; the same weight reordered once, at
load time, into the kernel's blocked layout reads faster (docs/bench/forward-profile.md has the numbers).
Fusing the projections that share an input (q, k, v; gate, up) into one matmul halves the number of kernel calls
and lets each read one longer weight.

Where verispec's own kernels run (verispec/kernels: an AVX-512 or an AVX2 build, on any thread count), a linear uses
them: they stream the weight once for every few rows and give a row the same bits whatever else shares the call.
Elsewhere, PyTorch's kernels, chosen by measurement (docs/bench/forward-profile.md): bfloat16 uses oneDNN
(`mkldnn._linear_pointwise`, bitwise equal to F.linear); float32 at one row uses MKL's packed sgemm
(`mkl._mkl_linear`), and at more rows oneDNN, each from its own packed copy (so a float32 model laid out for one
row holds its weights three times). Both keep a row's result independent of the other rows at a fixed row count, as
exact mode needs.
"""

from __future__ import annotations

from functools import partial
from itertools import groupby
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels
from verispec.checkpoints.blocks import QuantizedWeight
from verispec.checkpoints.mapped import forget_pages


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `PackedLinear` runs `dtype` on `device`: CPU float32 and bfloat16, on whatever kernels run here."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def _prepacked_here(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a `dtype` weight on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return torch.ops.mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16 else dtype == torch.float32


MANY_ROWS = 4  # the row count oneDNN lays a float32 weight out for beside MKL's one-row copy (the layout that ran
# faster than a one-row one at a few rows)


def packed_here(x: torch.Tensor) -> bool:
    """Whether the packed kernel may run: in inference mode (every NativeModel call), outside autocast. Training,
    gradients and autocast take the plain linears, which the packed weights were built from."""
    return torch.is_inference_mode_enabled() and not torch.is_autocast_enabled(x.device.type)


class PackedLinear(nn.Module):
    """One matmul for several linears that read the same input: `x @ cat(weights).T + cat(biases)`.

    `rows` is the row count (batch x tokens) the weight is laid out for: any other count works, more slowly.
    `own_kernels`: run verispec's matmul (verispec/kernels) instead, which lays the weight out for any count; by
    default `kernels.available`. The fused weight is built once from the linears, whose
    own weights become views of it (no second plain copy), so they keep their state-dict names and values. Holds no
    parameters: built on the model's final device and dtype, from weights that do not change afterwards. Outside
    inference mode, or under autocast, it runs the linears themselves (the kernels have no backward and take no part
    in autocast).

    Linears kept quantized (models/quant.py `QuantizedLinear`) run on verispec's quantized matmul, from their blocks,
    on float32 inputs (linears of several formats as `FormatRuns`); where the kernels do not run, on their weights
    dequantized.
    """

    def __init__(self, linears: Sequence[nn.Module], rows: int, own_kernels: bool | None = None) -> None:
        super().__init__()
        self.linears = tuple(linears)  # a tuple, not submodules: the linears stay where the state dict has them
        self.sizes = [linear.out_features for linear in linears]
        self.out_features, self.rows = sum(self.sizes), rows
        blocks = [getattr(linear, "quantized", None) for linear in linears]
        formats = {None if q is None else q.format for q in blocks}
        if own_kernels is None:
            own_kernels = kernels.available(torch.float32)
        if own_kernels and None not in formats:  # quantized
            self.weight = self.one_row = self.packed = None
            self.bias = _fused_bias(linears, torch.float32)
            self.kernel = (
                kernels.Matmul([q.blocks for q in blocks], self.bias, formats.pop())
                if len(formats) == 1
                else FormatRuns(blocks, self.bias)
            )
            for q in blocks:  # packed: blocks mapped from a file need not stay in memory beside their copy
                forget_pages(q.blocks)
            return
        weights = [linear.weight.detach() for linear in linears]
        self.weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        if len(linears) > 1 and None in formats:  # float linears' weights become views of the fused one
            for linear, part in zip(linears, self.weight.split(self.sizes)):
                if getattr(linear, "quantized", None) is None:
                    linear.weight.data = part
        self.bias = _fused_bias(linears, self.weight.dtype, self.weight.device)
        own_kernels = own_kernels and kernels.available(self.weight.dtype, self.weight.device)
        self.kernel = kernels.Matmul(self.weight, self.bias) if own_kernels else None
        if self.kernel is not None or not _prepacked_here(self.weight.dtype):
            # On verispec's kernels; or, where oneDNN cannot prepack this dtype on this CPU (bfloat16 needs
            # AVX-512), the fused weight through F.linear: one matmul still, with PyTorch's own kernel.
            self.one_row = self.packed = None
            return
        # float32 at one row: MKL's packed sgemm reads fastest; at more rows (verification, prefill) oneDNN does.
        one_row = self.weight.dtype == torch.float32 and rows == 1 and torch.backends.mkl.is_available()
        self.one_row = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1) if one_row else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, MANY_ROWS if one_row else rows)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """(..., in) -> (..., sum of the linears' out_features), plus `residual` if given (as `residual + y`)."""
        if self.kernel is not None and packed_here(x) and x.dtype == self.kernel.dtype:
            return self.kernel(x, residual)  # the residual added in the kernel, rounded as below
        if not packed_here(x) or self.weight is None:  # training, autocast; or quantized, on inputs of another dtype
            outputs = tuple(linear(x) for linear in self.linears)
            y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)
        elif self.kernel is not None or self.packed is None:  # no prepacked weight (or x of another dtype: F.linear
            # refuses it in PyTorch's words)
            y = F.linear(x, self.weight, self.bias)
        elif self.one_row is not None and x.numel() == x.shape[-1]:
            y = torch.ops.mkl._mkl_linear(x, self.one_row, self.weight, self.bias, 1)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y if residual is None else residual + y

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each linear's output (views of the one matmul's)."""
        if not packed_here(x):
            return tuple(linear(x) for linear in self.linears)
        return self(x).split(self.sizes, -1)


class FormatRuns:
    """Block-quantized linears of several formats that share an input (a GGUF's q and k in Q5_0 beside its v in
    Q8_0) as one matmul: each run of consecutive linears in one format on its own kernel, writing its columns of the
    one output. Each row's result is still its own, and the weights are read as their blocks (fused and dequantized
    to float32, they would be read as several times the bytes)."""

    dtype = torch.float32

    def __init__(self, blocks: Sequence[QuantizedWeight], bias: torch.Tensor | None) -> None:
        self.runs: list[tuple[int, kernels.Matmul]] = []
        start = 0
        for format, run in groupby(blocks, key=lambda q: q.format):
            weight = [q.blocks for q in run]
            n = sum(part.shape[0] for part in weight)
            self.runs.append((start, kernels.Matmul(weight, None if bias is None else bias[start : start + n], format)))
            start += n
        self.out_features = start
        self.kernel = "+".join(matmul.kernel for _, matmul in self.runs)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias) (+ residual), as `kernels.Matmul` gives it."""
        shape = (*x.shape[:-1], self.out_features)
        if residual is not None and residual.shape != shape:
            raise ValueError(f"a residual of {tuple(residual.shape)} for outputs {shape}")
        y = torch.empty(x.numel() // x.shape[-1], self.out_features, dtype=x.dtype)
        for start, matmul in self.runs:
            columns = slice(start, start + matmul.out_features)
            matmul(x, None if residual is None else residual[..., columns], out=y[:, columns])
        return y.view(shape)


def _fused_bias(
    linears: Sequence[nn.Module], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """The linears' biases side by side (zeros for one without), or None where none has one."""
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            torch.zeros(linear.out_features, dtype=dtype, device=device) if b is None else b.detach().to(dtype)
            for linear, b in zip(linears, biases)
        ]
    )


def rows_of(linear: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A linear over the outputs `ids` of `linear` only, in that order (an LM head over part of the vocabulary), in
    its format: an `nn.Linear` of its weight's rows, or a quantized linear's blocks for them."""
    if getattr(linear, "quantized", None) is not None:
        return linear.rows(ids)
    part = nn.Linear(linear.in_features, len(ids), bias=False, device="meta")
    part.weight = nn.Parameter(linear.weight.detach()[ids], requires_grad=False)
    return part


def matmul_by(weight: torch.Tensor, rows: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ weight.T` for a weight that belongs to no linear of its own (a drafter's LM head over a reduced
    vocabulary, taken once per generation): prepacked where this build can, else eager."""
    if not packable(weight.dtype, weight.device):
        return partial(F.linear, weight=weight)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return PackedLinear([linear], rows)
