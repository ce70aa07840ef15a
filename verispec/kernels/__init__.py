"""verispec's own CPU kernels: a weight-streaming matmul, attention over each row's visible keys, and the RMSNorm
and rotary embedding around them (one call each instead of a dozen PyTorch ops).

Both give a row the same bits whatever else shares the call (see cpu.cpp), and both read their inputs at about
the memory's rate at the row counts decoding uses (1 to 16): in bfloat16 a forward's matmuls read the weights at
about 25 GB/s on one Zen 4 core, against about 14 GB/s for oneDNN's prepacked kernels. They run on one thread.
`available` says whether this machine has them (kernels/build.py builds them at first use).
"""

from __future__ import annotations

import torch

from verispec.kernels.build import library, reason

__all__ = ["available", "reason", "pack", "linear", "attend", "rms_norm", "rotary_"]

COLS = 64  # output columns per packed weight block (cpu.cpp)
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the kernels run `dtype` tensors on `device` here (built on first call)."""
    return torch.device(device).type == "cpu" and dtype in _SUFFIX and library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight (N, K) laid out as the matmul kernel streams it: blocks of 64 output columns, in which
    bfloat16 weights sit as pairs of inputs ([N/64][K/2][64][2]) and float32 ones input by input ([N/64][K][64]);
    zero-padded."""
    N, K = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    padded = torch.zeros(-(-N // COLS) * COLS, -(-K // pair) * pair, dtype=weight.dtype, device=weight.device)
    padded[:N, :K] = weight
    return padded.view(-1, COLS, padded.shape[1] // pair, pair).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x (..., K) @ weight.T (+ bias) -> (..., N), with the weight as `pack` laid it out and `bias` float32."""
    *lead, K = x.shape
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
    kernel = getattr(library(), "vs_linear_" + _SUFFIX[x.dtype])
    kernel(rows.data_ptr(), rows.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
           out_features, rows.shape[0], out_features, K)
    return y.view(*lead, out_features)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention for R rows over the cache slots each sees: q (H, R, D) (any strides with the last dim unit), k and
    v (Hkv, S, D) contiguous, visible (R, S) uint8 -> (R, H * D), each row's softmax over its visible slots in slot
    order, the scale 1/sqrt(D)."""
    H, R, D = q.shape
    Hkv, S, _ = k.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    y = torch.empty(R, H * D, dtype=q.dtype, device=q.device)
    kernel = getattr(library(), "vs_attend_" + _SUFFIX[q.dtype])
    done = kernel(q.data_ptr(), q.stride(1), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), visible.data_ptr(),
                  S, y.data_ptr(), R, H, Hkv, D)
    if done != 0:
        raise ValueError(f"the attention kernel takes head dimensions up to 256; got {D}")
    return y


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as rows (R, D) with a unit last stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim, in float32, cast to x's dtype before the weight."""
    rows = _rows(x)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    getattr(library(), "vs_rms_norm_" + _SUFFIX[x.dtype])(rows.data_ptr(), rows.stride(0), weight.data_ptr(),
                                                          y.data_ptr(), y.stride(0), *rows.shape, eps)
    return y.view(x.shape)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (H, R, D) in place, a view with a unit last stride (q or k inside a projection's output), by the
    rows' cos and sin (R, D): x * cos + rotate_half(x) * sin, each step rounded to x's dtype."""
    H, R, D = x.shape
    cos, sin = cos.reshape(R, D).contiguous(), sin.reshape(R, D).contiguous()
    done = getattr(library(), "vs_rotary_" + _SUFFIX[x.dtype])(x.data_ptr(), x.stride(1), x.stride(0), R, H, D,
                                                              cos.data_ptr(), sin.data_ptr())
    if done != 0:
        raise ValueError(f"rotary embedding needs an even head dimension; got {D}")
    return x
