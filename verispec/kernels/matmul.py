"""The weight-streaming matmul: a linear's weight packed once as the kernel streams it (float32, bfloat16, or ggml's
blocks kept as they are), then x @ weight.T (+ bias, + a residual) on it for any number of rows."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from verispec.kernels import quant_pack
from verispec.kernels.build import library
from verispec.kernels.calls import as_rows, call, kernel_for
from verispec.kernels.quant_pack import QUANTIZED


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight (N, K) laid out as the matmul kernel streams it: blocks of the build's width in output
    columns (`vs_cols`: 64 on AVX-512, 16 on AVX2), in which bfloat16 weights sit as pairs of inputs
    ([N/C][K/2][C][2]) and float32 ones input by input ([N/C][K][C]); zero-padded."""
    N, K = weight.shape
    cols = library().vs_cols()
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    padded = torch.zeros(-(-N // cols) * cols, -(-K // pair) * pair, dtype=weight.dtype, device=weight.device)
    padded[:N, :K] = weight
    return padded.view(-1, cols, padded.shape[1] // pair, pair).transpose(1, 2).contiguous()


def _parts(blocks: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A weight's blocks as the list of the weights' blocks that make it, row by row (one, or several)."""
    return [blocks] if isinstance(blocks, torch.Tensor) else list(blocks)


def pack_quantized(format: str, blocks: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """A weight in ggml's blocks (N, K / block inputs * block bytes) of `format` (one of `QUANTIZED`), uint8 rows at
    any stride (only read: a read-only memory map will do), laid out as the quantized matmul streams it
    (kernels/pack.cpp): (N / 16 rounded up, K / block inputs, packed block bytes), rows past N padded as all-zero
    blocks. Several weights' blocks (a sequence) are packed as their rows stacked would be, without stacking them."""
    parts = _parts(blocks)
    for part in parts:
        if (
            format not in QUANTIZED
            or part.dtype != torch.uint8
            or part.dim() != 2
            or part.device.type != "cpu"
            or part.shape[1] != parts[0].shape[1]
            or part.shape[1] % quant_pack.bytes_per_block(format)
        ):
            raise ValueError(
                f"a quantized matmul takes CPU uint8 blocks of one of {', '.join(QUANTIZED)}, rows of "
                f"one width; got {format!r} {part.dtype} {tuple(part.shape)} on {part.device}"
            )
    if any(part.shape[0] % quant_pack.QUANT_COLS for part in parts[:-1]):  # a part that ends inside a column block
        parts = [torch.cat(parts)]
    N, nb = sum(part.shape[0] for part in parts), parts[0].shape[1] // quant_pack.bytes_per_block(format)
    # numpy's memory, not torch's: numpy asks Linux for huge pages for a large array (MADV_HUGEPAGE), and a weight
    # streamed through 2 MB pages instead of 4 KB ones misses the TLB far less (commit dcb766f measured the difference)
    packed = torch.from_numpy(np.empty((-(-N // quant_pack.QUANT_COLS), nb, quant_pack.packed_bytes(format)), np.uint8))
    start = 0
    for part in parts:
        if part.stride(1) != 1:
            part = part.contiguous()
        call(
            "pack_quantized",
            [
                part,
                part.shape[0],
                part.stride(0),
                nb,
                list(QUANTIZED).index(format),
                packed[start // quant_pack.QUANT_COLS :],
            ],
        )
        start += part.shape[0]
    return packed


class Matmul:
    """x (..., K) -> x @ weight.T (+ bias) (..., N) on the kernel, the weight (N, K) packed once (`pack`) and the bias
    kept in float32; checked here once, so that a call checks only its input. With `format` (one of `QUANTIZED`),
    `weight` is the (N, K / 32 * block bytes) uint8 blocks of a weight in that format, or several weights' blocks
    that make it row by row (`pack_quantized`), and x is float32."""

    def __init__(
        self, weight: torch.Tensor | Sequence[torch.Tensor], bias: torch.Tensor | None = None, format: str | None = None
    ) -> None:
        if format is None:
            self.out_features, self.in_features = weight.shape
            self.kernel = kernel_for("linear", weight)  # checks the dtype
            self.dtype, self.packed = weight.dtype, pack(weight)
        else:
            self.kernel, self.dtype, self.packed = f"linear_{format}", torch.float32, pack_quantized(format, weight)
            self.out_features = sum(part.shape[0] for part in _parts(weight))
            self.in_features = self.packed.shape[1] * quant_pack.inputs_per_block(format)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"a bias of {tuple(bias.shape)} for {self.out_features} outputs")
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias), plus `residual` (..., N) if given, added as `residual + (x @ weight.T)` would be;
        written into `out` if given (rows (R, N) with a unit last stride: some columns of a wider output, sharing
        no memory with x or the residual)."""
        if x.dtype != self.dtype or x.shape[-1] != self.in_features or x.device.type != "cpu":
            raise ValueError(
                f"this matmul takes CPU {self.dtype} rows of {self.in_features}; got {x.dtype} "
                f"{tuple(x.shape)} on {x.device}"
            )
        shape = (*x.shape[:-1], self.out_features)
        rows, res = as_rows(x), None
        if residual is not None:
            if residual.shape != shape or residual.dtype != self.dtype or residual.device.type != "cpu":
                raise ValueError(f"a residual of {residual.dtype} {tuple(residual.shape)} for outputs {shape}")
            res = as_rows(residual)
        if out is None:
            y = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        elif (
            out.shape != (rows.shape[0], self.out_features)
            or out.dtype != x.dtype
            or out.stride(-1) != 1
            or out.device.type != "cpu"
        ):
            raise ValueError(
                f"an output of {out.dtype} {tuple(out.shape)} strides {out.stride()} for "
                f"{rows.shape[0]} rows of {self.out_features} {x.dtype} (unit last stride)"
            )
        else:
            y = out
        call(
            self.kernel,
            [
                rows,
                rows.stride(0),
                self.packed,
                self.bias,
                y,
                y.stride(0),
                rows.shape[0],
                self.out_features,
                self.in_features,
                res,
                0 if res is None else res.stride(0),
            ],
        )
        return y if out is not None else y.view(shape)
