"""The numpy reference for kernels.pack_quantized (kernels/pack.cpp): a block-quantized weight laid out as the
quantized matmul streams it (quant.cpp, whose header describes the layout): ggml's blocks taken apart into their
scales and quants (`parts`), then put back together by blocks of 16 output columns and 32 inputs, each block's scales
then its quants in groups of 4 inputs, column by column (`pack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verispec.kernels.quant_pack import QUANT_COLS, bytes_per_block

SUPER = 8  # packed blocks per K-quant super-block of 256 inputs (quant.cpp SUPER)


@dataclass
class Parts:
    """A weight's blocks of 32 inputs taken apart, each array by (row, block of 32): `scales`, byte arrays in the
    order the packed block keeps them; `quants`, Q8_0's 32 bytes (q + 128) or the others' 16 bytes of nibbles in
    ggml's Q4_0 order; `high`, the bits above the nibbles by input (Q5: 0 or 1, Q6_K: 0 to 3); and for a K-quant,
    `header`, byte arrays by (row, super-block)."""

    scales: list[np.ndarray]
    quants: np.ndarray
    high: np.ndarray | None = None
    header: tuple[np.ndarray, ...] = ()


def _nibbles(values: np.ndarray) -> np.ndarray:
    """Values 0..15 by (..., 32 inputs) as ggml's Q4_0 bytes: input j in byte j's low nibble, j + 16 in its high."""
    return (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)


def parts(format: str, blocks: np.ndarray) -> Parts:
    """ggml's blocks (N, row bytes) of `format` taken apart (as ggml's dequantize_row_* reads them)."""
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, bytes_per_block(format))
    if format == "q8_0":
        return Parts([b[..., 0:2]], b[..., 2:] ^ 0x80)
    if format in ("q4_0", "q4_1"):
        return Parts([b[..., 0:2], *([b[..., 2:4]] if format == "q4_1" else [])], b[..., -16:])
    if format in ("q5_0", "q5_1"):
        qh = np.unpackbits(b[..., -20:-16], axis=-1, bitorder="little")  # (N, nb, 32): input j's bit 4
        return Parts([b[..., 0:2], *([b[..., 2:4]] if format == "q5_1" else [])], b[..., -16:], qh)
    if format in ("q4_k", "q5_k"):
        s = b[..., 4:16]  # 8 six-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
        m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        qs = b[..., -128:].reshape(N, -1, 4, 1, 32)  # 64 inputs per 32 bytes: low nibbles, then high ones
        values = np.concatenate([qs & 0xF, qs >> 4], -2).reshape(N, -1, 32)  # (N, blocks of 32, 32)
        high = None
        if format == "q5_k":  # byte l of qh holds bit 4 of input l of each block of 32, block j in bit j
            qh = b[..., 16:48].reshape(N, -1, 1, 32)
            high = ((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1).reshape(N, -1, 32)
        return Parts(
            [sc.reshape(N, -1, 1), m.reshape(N, -1, 1)], _nibbles(values), high, header=(b[..., 0:2], b[..., 2:4])
        )
    if format == "q6_k":
        ql, qh = b[..., 0:128].reshape(N, -1, 2, 2, 1, 32), b[..., 128:192].reshape(N, -1, 2, 1, 1, 32)
        low = np.concatenate([ql & 0xF, ql >> 4], -2)  # (N, nb, half, 32-byte run, low/high nibble, 32)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(2, 2, 1)  # as (nibble, run) pairs read them
        high = (qh >> shifts.transpose(1, 0, 2)[None, None, None]) & 3  # (N, nb, half, run, nibble, 32)
        values = (low | (high << 4)).transpose(0, 1, 2, 4, 3, 5).reshape(N, -1, 32)  # input order: 0..255
        sc = b[..., 192:208].reshape(N, -1, 2)  # int8 by 16 inputs: each block of 32's two
        return Parts([sc[..., 0:1], sc[..., 1:2]], _nibbles(values & 0xF), values >> 4, header=(b[..., 208:210],))
    raise ValueError(f"no packing for {format!r}")


def _by_column(x: np.ndarray) -> np.ndarray:
    """(N/16 * 16, n, k) -> (N/16, n, 16 * k): a block's 16 columns' bytes side by side."""
    cb, n, k = x.shape[0] // QUANT_COLS, x.shape[1], x.shape[2]
    return x.reshape(cb, QUANT_COLS, n, k).transpose(0, 2, 1, 3).reshape(cb, n, QUANT_COLS * k)


def _groups(quants: np.ndarray) -> np.ndarray:
    """(rows, n, bytes) -> (N/16, n, groups, 16 columns, 4): each group the 16 columns' 4 bytes."""
    cb, n = quants.shape[0] // QUANT_COLS, quants.shape[1]
    q = quants.reshape(cb, QUANT_COLS, n, -1, 4).transpose(0, 2, 3, 1, 4)
    return q.reshape(cb, n, -1)


def _high(format: str, high: np.ndarray) -> np.ndarray:
    """The bits above the nibbles, by (N/16, n), laid out as the group's bytes (column, then input): Q5's bit 4 as
    bit planes, byte i holding it for byte i of each group's low nibbles (bit 2g) and high ones (bit 2g + 1), so a
    shift and a mask take a group's bits out; Q6_K's bits 4-5 as two bits per group byte."""
    cb, n = high.shape[0] // QUANT_COLS, high.shape[1]
    h = high.reshape(cb, QUANT_COLS, n, 2, 4, 4).transpose(0, 2, 4, 3, 1, 5)  # (cb, n, group, lo/hi, column, input)
    if format in ("q5_0", "q5_1", "q5_k"):
        planes = h.reshape(cb, n, 8, 64).transpose(0, 1, 3, 2)  # (cb, n, byte, plane 2g + lo/hi)
        return np.packbits(planes, axis=-1, bitorder="little").reshape(cb, n, 64)
    pairs = h.reshape(cb, n, 2, 4, 64)  # two groups' lo, hi, lo, hi fields as one byte's bits 0-1, 2-3, 4-5, 6-7
    fields = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 2) | (pairs[:, :, :, 2] << 4) | (pairs[:, :, :, 3] << 6)
    return fields.astype(np.uint8).reshape(cb, n, 128)


def pack(format: str, blocks: torch.Tensor) -> torch.Tensor:
    """ggml's blocks (N, K / block inputs * block bytes) of `format`, row by row, as the quantized matmul streams them:
    (N/16, K/32, packed block bytes), or for a K-quant (N/16, K/256, header + 8 packed blocks); rows past N pad with
    zero scales."""
    N = blocks.shape[0]
    padded = np.zeros((-(-N // QUANT_COLS) * QUANT_COLS, blocks.shape[1]), dtype=np.uint8)
    padded[:N] = blocks.numpy()
    p = parts(format, padded)
    fields = [*map(_by_column, p.scales), _groups(p.quants)]
    if p.high is not None:
        fields.append(_high(format, p.high))
    packed = np.concatenate(fields, -1)
    if p.header:
        cb, n = packed.shape[:2]
        header = np.concatenate([_by_column(h) for h in p.header], -1)
        packed = np.concatenate([header, packed.reshape(cb, n // SUPER, -1)], -1)
    return torch.from_numpy(np.ascontiguousarray(packed))
