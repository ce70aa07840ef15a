"""Attention over a layer's key/value cache: new keys and values stored into their slots, and each row's softmax over
the slots it sees."""

from __future__ import annotations

import ctypes

import torch

from verispec.kernels.calls import SUFFIX, call, float_bits, kernel_for, widened

MAX_HEAD_DIM = 256  # the attention kernel's largest head (attend.cpp MAX_LANES x 16)


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
    kernel = kernel_for("attend", q) + "_f16" if widened(q, k, v) else kernel_for("attend", q, k, v)
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
    scalar_bits = float_bits(D if scalar is None else scalar)
    call(
        kernel, [q, q.stride(1), q.stride(0), k, v, k.stride(0), visible, S, y, R, H, Hkv, D, window or 0, scalar_bits]
    )
    return y


def store_kv(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: ctypes.c_int64) -> None:
    """New keys and values k, v (R, Hkv * D) (rows of one stride, unit last stride) into a layer's cache keys, values
    (Hkv, S, D) (contiguous) at slots start.value .. + R - 1, `start` read when the call runs (or is replayed)."""
    Hkv, S, D = keys.shape
    widen = widened(k, keys, values) and v.dtype == torch.float32
    same = (k.dtype, v.dtype, values.dtype) == (keys.dtype,) * 3 and keys.dtype in SUFFIX
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
    if call(
        "store_kv_f16" if widen else "store_kv",
        [k, v, k.stride(0), R, Hkv, D, keys, values, S, start, keys.element_size()],
    ):
        raise IndexError(f"store_kv: slots {start.value} .. {start.value + R - 1} outside a cache of {S}")
