"""verispec's own CPU kernels: a weight-streaming matmul, attention over each row's visible keys (or the last of them:
a sliding window), the row-wise work around them (RMSNorm of rows or heads, rotary, silu(gate) * up and gelu(gate) * up,
scaled rows, embedding and rotary rows by index, new keys into the cache), a causal
forward's positions and visible slots, the argmax and a greedy chain's step to its next token, so that a forward on
them, and a decoding step around it, is nothing but kernel calls and can be captured and replayed
(kernels/capture.py).

Each gives a row the same bits whatever else shares the call (see simd.h), and the matmul reads its weight at
about the memory's rate at the row counts decoding uses, faster than oneDNN's prepacked kernels (see
docs/bench/forward-profile.md for the measurements). They run on their own pool of threads (pool.cpp), which splits
each call over output columns, heads or rows, never over a sum, so a row's bits are the same at any thread count;
`verispec.set_threads` sets the count.
`available` says whether this machine has them (kernels/build.py builds them at first use). The wrappers check
what the C code cannot (dtypes, shapes, strides) and raise ValueError: a wrong call must never read out of bounds.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Sequence, Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML

from verispec.kernels import quant_pack
from verispec.kernels.build import isa, library, reason
from verispec.kernels.capture import NotCapturable, Program, capturing, kernel_address, note
from verispec.kernels.quant_pack import QUANTIZED

__all__ = [
    "available",
    "reason",
    "isa",
    "pack",
    "pack_quantized",
    "Matmul",
    "attend",
    "rms_norm",
    "head_norm_",
    "rotary_",
    "silu_mul",
    "gelu_tanh_mul",
    "scale_",
    "gather",
    "gather_blocks",
    "store_kv",
    "argmax",
    "causal_rows",
    "next_token",
    "run",
    "program",
    "Program",
    "address",
    "capturing",
    "NotCapturable",
    "MAX_HEAD_DIM",
    "QUANTIZED",
    "TABLES",
]

MAX_HEAD_DIM = 256  # the attention kernel's largest head (attend.cpp MAX_LANES x 16)
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# The formats `gather_blocks` reads a table's rows in, as ggml's types: the quantized ones the kernels keep as blocks,
# and a GGUF's unquantized tables
TABLES = {**QUANTIZED, "f32": GGML.F32, "f16": GGML.F16, "bf16": GGML.BF16}


def available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the kernels run `dtype` tensors on `device` here (built on first call)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # (each step asks)
    return kind == "cpu" and dtype in _SUFFIX and library() is not None


def _widened(x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether float32 rows `x` go with a float16 cache's keys and values (on the CPU)."""
    return (
        x.dtype == torch.float32
        and keys.dtype == values.dtype == torch.float16
        and keys.device.type == values.device.type == "cpu"
    )


def _kernel(name: str, *tensors: torch.Tensor) -> str:
    """The kernel `name` for these tensors' one dtype, after checking that they are CPU tensors of it."""
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        raise ValueError(
            f"verispec's {name} takes CPU float32 or bfloat16 tensors of one dtype; got "
            f"{[(t.dtype, t.device.type) for t in tensors]}"
        )
    return f"{name}_{_SUFFIX[dtype]}"


Arg = Union[int, torch.Tensor, ctypes.c_int64, None]  # a number, or what a pointer points to (None: a null pointer)


def address(arg: Arg) -> int:
    """The word a kernel takes for `arg`: a tensor's data pointer, a cell's address, 0 for None, a number itself."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    if isinstance(arg, ctypes.c_int64):
        return ctypes.addressof(arg)
    return 0 if arg is None else arg


def _call(name: str, args: Sequence[Arg]) -> int:
    """Run kernel `name` on its arguments, pointers given as the tensors or cells they point to (and record the
    call if a forward is being captured, with what each pointer points into); its status."""
    words = [address(arg) for arg in args]
    status = getattr(library(), f"vs_{name}")((ctypes.c_int64 * len(words))(*words))
    if status == 0:
        note(name, words, args)
    return status


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as rows (R, D) with a unit last stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


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
    # streamed through 2 MB pages instead of 4 KB ones decodes measurably faster (the measure: commit dcb766f)
    packed = torch.from_numpy(np.empty((-(-N // quant_pack.QUANT_COLS), nb, quant_pack.packed_bytes(format)), np.uint8))
    start = 0
    for part in parts:
        if part.stride(1) != 1:
            part = part.contiguous()
        _call(
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
            self.kernel = _kernel("linear", weight)  # checks the dtype
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
        rows, res = _rows(x), None
        if residual is not None:
            if residual.shape != shape or residual.dtype != self.dtype or residual.device.type != "cpu":
                raise ValueError(f"a residual of {residual.dtype} {tuple(residual.shape)} for outputs {shape}")
            res = _rows(residual)
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
        _call(
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


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    window: int | None = None,
    scalar: float | None = None,
) -> torch.Tensor:
    """Attention for R rows over the cache slots each sees: q (H, R, D) (any strides with the last dim unit), k and
    v (Hkv, S, D) with the same strides, each slot's D values contiguous, visible (R, S) uint8 -> (R, H * D), each
    row's softmax over its visible slots in slot order (`window`: over the last `window` of them only), the scale
    1/sqrt(`scalar`) (default D). k and v are q's dtype, or float16 for float32 queries (a float16 cache)."""
    H, R, D = q.shape
    Hkv, S, _ = k.shape
    kernel = _kernel("attend", q) + "_f16" if _widened(q, k, v) else _kernel("attend", q, k, v)
    if v.shape != k.shape or k.shape[2] != D or v.stride() != k.stride() or k.stride()[1:] != (D, 1):
        raise ValueError(
            f"keys and values must be (Hkv, S, {D}) with rows of {D} contiguous; got {tuple(k.shape)} "
            f"strides {k.stride()} and {tuple(v.shape)} strides {v.stride()}"
        )
    if H % Hkv or D > MAX_HEAD_DIM:
        raise ValueError(f"attention over {H} heads from {Hkv} key heads of {D} (at most {MAX_HEAD_DIM}) values")
    if visible.dtype != torch.uint8 or visible.shape != (R, S) or not visible.is_contiguous():
        raise ValueError(f"visible must be a contiguous uint8 ({R}, {S}); got {visible.dtype} {tuple(visible.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if window is not None and window < 1:
        raise ValueError(f"a sliding window of {window} keys")
    y = torch.empty(R, H * D, dtype=q.dtype, device=q.device)
    scalar_bits = _float_bits(D if scalar is None else scalar)
    _call(
        kernel, [q, q.stride(1), q.stride(0), k, v, k.stride(0), visible, S, y, R, H, Hkv, D, window or 0, scalar_bits]
    )
    return y


def _float_bits(x: float) -> int:
    """A float32's bits, as a kernel takes a float argument."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim, in float32, cast to x's dtype before the weight; plus
    `residual` (x's shape and dtype) where given, added as `residual + y` would be."""
    kernel = _kernel("rms_norm", x, weight) if residual is None else _kernel("rms_norm", x, weight, residual)
    if weight.shape != x.shape[-1:] or not weight.is_contiguous():
        raise ValueError(f"an RMSNorm weight {tuple(weight.shape)} for inputs of {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"a residual of {tuple(residual.shape)} for an RMSNorm of {tuple(x.shape)}")
    rows, res = _rows(x), None if residual is None else _rows(residual)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _call(
        kernel,
        [
            rows,
            rows.stride(0),
            weight,
            y,
            y.stride(0),
            *rows.shape,
            _float_bits(eps),
            res,
            0 if res is None else res.stride(0),
        ],
    )
    return y.view(x.shape)


def head_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of each head of x (H, R, D) in place, a view with a unit last stride (q or k inside a projection's
    output), by one weight (D,)."""
    H, R, D = x.shape
    kernel = _kernel("head_norm", x, weight)
    if x.stride(-1) != 1 or weight.shape != (D,) or not weight.is_contiguous():
        raise ValueError(f"a head norm of (H, R, D) = {tuple(x.shape)} (unit last stride) by {tuple(weight.shape)}")
    _call(kernel, [x, x.stride(1), x.stride(0), R, H, D, weight, _float_bits(eps)])
    return x


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (H, R, D) in place, a view with a unit last stride (q or k inside a projection's output), by the
    rows' cos and sin (R, D): x * cos + rotate_half(x) * sin, each step rounded to x's dtype."""
    H, R, D = x.shape
    kernel = _kernel("rotary", x, cos, sin)
    if x.stride(-1) != 1 or D % 2 or cos.numel() != R * D or sin.numel() != R * D:
        raise ValueError(
            f"rotary embedding of (H, R, D) = {tuple(x.shape)} (D even, unit last stride) by tables of "
            f"{tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    cos, sin = cos.reshape(R, D).contiguous(), sin.reshape(R, D).contiguous()
    _call(kernel, [x, x.stride(1), x.stride(0), R, H, D, cos, sin])
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
    kernel = _kernel(name, x)
    if x.shape[-1] % 2:
        raise ValueError(f"{name} takes [gate | up] halves; got rows of {x.shape[-1]}")
    rows = _rows(x)
    half = rows.shape[1] // 2
    y = torch.empty(rows.shape[0], half, dtype=x.dtype, device=x.device)
    _call(kernel, [rows, rows.stride(0), y, y.stride(0), rows.shape[0], half])
    return y.view(*x.shape[:-1], half)


def scale_(x: torch.Tensor, s: float) -> torch.Tensor:
    """x *= s in place, rows (R, D) with a unit last stride: s rounded to x's dtype (as `torch.tensor(s, dtype=...)`
    holds it) and each product rounded to it, as `x * torch.tensor(s, dtype=x.dtype)` gives it."""
    kernel = _kernel("scale", x)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"scale_ takes rows (R, D) with a unit last stride; got {tuple(x.shape)} strides {x.stride()}")
    _call(kernel, [x, x.stride(0), *x.shape, _float_bits(s)])
    return x


def gather(table: torch.Tensor, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """table[index]: rows (N, D) by int64 indices (R,) -> (R, D), in `dtype` (default the table's; a bfloat16 table's
    rows also widened, exactly, to float32); an index outside 0..N-1 raises IndexError (and fails a replay) before
    anything is read."""
    if table.dim() != 2 or table.stride(-1) != 1 or table.device.type != "cpu" or table.dtype not in _SUFFIX:
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
        failed = _call("gather_widen", [table, N, table.stride(0), index, R, D, y, D])
    else:
        failed = _call("gather", [table, N, table.stride(0), index, R, D, y, D, table.element_size()])
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
    if _call("gather_blocks", [blocks, N, blocks.stride(0) if N > 1 else row, index, R, D, y, D, int(TABLES[format])]):
        raise IndexError(f"an index outside the {N} rows of a {format} table of {tuple(blocks.shape)} bytes")
    return y


def store_kv(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: ctypes.c_int64) -> None:
    """New keys and values k, v (R, Hkv * D) (rows of one stride, unit last stride) into a layer's cache keys, values
    (Hkv, S, D) (contiguous) at slots start.value .. + R - 1, `start` read when the call runs (or is replayed)."""
    Hkv, S, D = keys.shape
    widen = _widened(k, keys, values) and v.dtype == torch.float32
    same = (k.dtype, v.dtype, values.dtype) == (keys.dtype,) * 3 and keys.dtype in _SUFFIX
    if not (widen or same) or not (keys.is_contiguous() and values.is_contiguous() and values.shape == keys.shape):
        raise ValueError(
            f"store_kv: caches of one dtype (the rows', or float16 for float32 rows), contiguous (Hkv, "
            f"S, D); got {keys.dtype} {tuple(keys.shape)} for {k.dtype} rows"
        )
    R = k.shape[0]
    if k.shape != (R, Hkv * D) or v.shape != k.shape or k.stride() != v.stride() or k.stride(-1) != 1:
        raise ValueError(
            f"store_kv: new keys and values ({R}, {Hkv * D}) alike; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if _call(
        "store_kv_f16" if widen else "store_kv",
        [k, v, k.stride(0), R, Hkv, D, keys, values, S, start, keys.element_size()],
    ):
        raise IndexError(f"store_kv: slots {start.value} .. {start.value + R - 1} outside a cache of {S}")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for rows x (R, V) with a unit last stride: the first index of each row's largest value, a
    NaN counting as the largest -> (R,) int64."""
    kernel = _kernel("argmax", x)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"argmax takes rows (R, V) with a unit last stride; got {tuple(x.shape)} strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _call(kernel, [x, x.stride(0), *x.shape, out])
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
    kernel = _kernel("next_token", logits)
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
