"""The row-wise work around the matmul and attention (kernels/rows.cpp): RMSNorm (of rows, or of each head),
rotary embedding, silu(gate) * up and gelu(gate) * up, scaled rows, and rows of a table by index, from float tables or
from ggml's blocks."""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML

from verispec.kernels.calls import SUFFIX, as_rows, call, float_bits, kernel_for
from verispec.kernels.quant_pack import QUANTIZED

# The formats `gather_blocks` reads a table's rows in, as ggml's types: the quantized ones the kernels keep as blocks,
# and a GGUF's unquantized tables
TABLES = {**QUANTIZED, "f32": GGML.F32, "f16": GGML.F16, "bf16": GGML.BF16}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim, in float32, cast to x's dtype before the weight; plus
    `residual` (x's shape and dtype) where given, added as `residual + y` would be."""
    kernel = kernel_for("rms_norm", x, weight) if residual is None else kernel_for("rms_norm", x, weight, residual)
    if weight.shape != x.shape[-1:] or not weight.is_contiguous():
        raise ValueError(f"an RMSNorm weight {tuple(weight.shape)} for inputs of {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"a residual of {tuple(residual.shape)} for an RMSNorm of {tuple(x.shape)}")
    rows, res = as_rows(x), None if residual is None else as_rows(residual)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    stride = 0 if res is None else res.stride(0)
    call(kernel, [rows, rows.stride(0), weight, y, y.stride(0), *rows.shape, float_bits(eps), res, stride])
    return y.view(x.shape)


def head_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of each head of x (H, R, D) in place, a view with a unit last stride (q or k inside a projection's
    output), by one weight (D,)."""
    H, R, D = x.shape
    kernel = kernel_for("head_norm", x, weight)
    if x.stride(-1) != 1 or weight.shape != (D,) or not weight.is_contiguous():
        raise ValueError(f"a head norm of (H, R, D) = {tuple(x.shape)} (unit last stride) by {tuple(weight.shape)}")
    call(kernel, [x, x.stride(1), x.stride(0), R, H, D, weight, float_bits(eps)])
    return x


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (H, R, D) in place, a view with a unit last stride (q or k inside a projection's output), by the
    rows' cos and sin (R, D): x * cos + rotate_half(x) * sin, each step rounded to x's dtype."""
    H, R, D = x.shape
    kernel = kernel_for("rotary", x, cos, sin)
    if x.stride(-1) != 1 or D % 2 or cos.numel() != R * D or sin.numel() != R * D:
        raise ValueError(
            f"rotary embedding of (H, R, D) = {tuple(x.shape)} (D even, unit last stride) by tables of "
            f"{tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    cos, sin = cos.reshape(R, D).contiguous(), sin.reshape(R, D).contiguous()
    call(kernel, [x, x.stride(1), x.stride(0), R, H, D, cos, sin])
    return x


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I) = [gate | up] -> silu(gate) * up (..., I), silu rounded to x's dtype before the product."""
    return _gated("silu_mul", x)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I) = [gate | up] -> gelu(gate) * up (..., I), gelu's tanh approximation (PyTorch's
    `approximate="tanh"`, as g / (1 + e^(-2u))), rounded to x's dtype before the product."""
    return _gated("gelu_tanh_mul", x)


def _gated(name: str, x: torch.Tensor) -> torch.Tensor:
    """An activation of the gate times the up projection, by kernel `name`."""
    kernel = kernel_for(name, x)
    if x.shape[-1] % 2:
        raise ValueError(f"{name} takes [gate | up] halves; got rows of {x.shape[-1]}")
    rows = as_rows(x)
    half = rows.shape[1] // 2
    y = torch.empty(rows.shape[0], half, dtype=x.dtype, device=x.device)
    call(kernel, [rows, rows.stride(0), y, y.stride(0), rows.shape[0], half])
    return y.view(*x.shape[:-1], half)


def scale_(x: torch.Tensor, s: float) -> torch.Tensor:
    """x *= s in place, rows (R, D) with a unit last stride: s rounded to x's dtype (as `torch.tensor(s, dtype=...)`
    holds it) and each product rounded to it, as `x * torch.tensor(s, dtype=x.dtype)` gives it."""
    kernel = kernel_for("scale", x)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"scale_ takes rows (R, D) with a unit last stride; got {tuple(x.shape)} strides {x.stride()}")
    call(kernel, [x, x.stride(0), *x.shape, float_bits(s)])
    return x


def gather(table: torch.Tensor, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """table[index]: rows (N, D) by int64 indices (R,) -> (R, D), in `dtype` (default the table's; a bfloat16 table's
    rows also widened, exactly, to float32); an index outside 0..N-1 raises IndexError (and fails a replay) before
    anything is read."""
    if table.dim() != 2 or table.stride(-1) != 1 or table.device.type != "cpu" or table.dtype not in SUFFIX:
        raise ValueError(
            f"gather reads rows of a CPU float32 or bfloat16 table; got {table.dtype} {tuple(table.shape)}"
        )
    if index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous() or index.device.type != "cpu":
        raise ValueError(f"gather takes a contiguous CPU int64 index vector; got {index.dtype} {tuple(index.shape)}")
    dtype = table.dtype if dtype is None else dtype
    widen = (table.dtype, dtype) == (torch.bfloat16, torch.float32)
    if dtype != table.dtype and not widen:
        raise ValueError(
            f"gather copies a table's rows, or widens bfloat16 ones to float32; not {table.dtype} to {dtype}"
        )
    R, (N, D) = len(index), table.shape
    y = torch.empty(R, D, dtype=dtype, device=table.device)
    if widen:
        failed = call("gather_widen", [table, N, table.stride(0), index, R, D, y, D])
    else:
        failed = call("gather", [table, N, table.stride(0), index, R, D, y, D, table.element_size()])
    if failed:
        raise IndexError(f"an index outside the {N} rows of a table of {tuple(table.shape)}")
    return y


def gather_blocks(blocks: torch.Tensor, format: str, index: torch.Tensor) -> torch.Tensor:
    """Rows of a table kept in ggml's `format` (one of `TABLES`): `blocks` (N, row bytes) uint8, each row its blocks
    (a GGUF tensor's data, a memory map's view: only read), by int64 indices (R,) -> float32 (R, D), D the inputs a
    row, each value with the bits `gguf.quants.dequantize` gives it; an index outside 0..N-1 raises IndexError (and
    fails a replay) before anything is read."""
    if format not in TABLES:
        raise ValueError(f"gather_blocks reads tables in {', '.join(TABLES)}; not {format!r}")
    inputs, size = GGML_QUANT_SIZES[TABLES[format]]
    if (
        blocks.dtype != torch.uint8
        or blocks.dim() != 2
        or blocks.stride(-1) != 1
        or blocks.device.type != "cpu"
        or blocks.shape[1] % size
        or (len(blocks) > 1 and blocks.stride(0) < blocks.shape[1])
    ):
        raise ValueError(
            f"gather_blocks reads a CPU uint8 table (N, row bytes) of {format} blocks of {size} bytes, "
            f"rows apart; got {blocks.dtype} {tuple(blocks.shape)} strides {blocks.stride()}"
        )
    if index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous() or index.device.type != "cpu":
        raise ValueError(
            f"gather_blocks takes a contiguous CPU int64 index vector; got {index.dtype} {tuple(index.shape)}"
        )
    R, (N, row) = len(index), blocks.shape
    D = row // size * inputs
    y = torch.empty(R, D, dtype=torch.float32, device=blocks.device)
    if call("gather_blocks", [blocks, N, blocks.stride(0) if N > 1 else row, index, R, D, y, D, int(TABLES[format])]):
        raise IndexError(f"an index outside the {N} rows of a {format} table of {tuple(blocks.shape)} bytes")
    return y
