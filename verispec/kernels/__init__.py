"""verispec's own CPU kernels: a weight-streaming matmul, attention over each row's visible keys, and the RMSNorm
and rotary embedding around them (one call each instead of a dozen PyTorch ops).

Each gives a row the same bits whatever else shares the call (see cpu.cpp), and the matmul reads its weight at
about the memory's rate at the row counts decoding uses: in bfloat16 a forward's matmuls read the weights at about
25 GB/s on one Zen 4 core, against about 14 GB/s for oneDNN's prepacked kernels. They run on one thread.
`available` says whether this machine has them (kernels/build.py builds them at first use). The wrappers check
what the C code cannot (dtypes, shapes, strides) and raise ValueError: a wrong call must never read out of bounds.
"""

from __future__ import annotations

import torch

from verispec.kernels.build import library, reason

__all__ = ["available", "chosen", "reason", "pack", "Matmul", "attend", "rms_norm", "rotary_", "MAX_HEAD_DIM"]

COLS = 64  # output columns per packed weight block (cpu.cpp)
MAX_HEAD_DIM = 256  # the attention kernel's largest head (cpu.cpp MAX_LANES x 16)
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the kernels run `dtype` tensors on `device` here (built on first call)."""
    return torch.device(device).type == "cpu" and dtype in _SUFFIX and library() is not None


def chosen(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether a model loaded now takes the kernels by default: where they are available and torch runs one thread.
    They run on one; with more, PyTorch's multi-threaded kernels read the weights with more cores."""
    return torch.get_num_threads() == 1 and available(dtype, device)


def _kernel(name: str, *tensors: torch.Tensor):
    """The C function `name` for these tensors' one dtype, after checking that they are CPU tensors of it."""
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        raise ValueError(f"verispec's {name} takes CPU float32 or bfloat16 tensors of one dtype; got "
                         f"{[(t.dtype, t.device.type) for t in tensors]}")
    return getattr(library(), f"vs_{name}_{_SUFFIX[dtype]}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as rows (R, D) with a unit last stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight (N, K) laid out as the matmul kernel streams it: blocks of 64 output columns, in which
    bfloat16 weights sit as pairs of inputs ([N/64][K/2][64][2]) and float32 ones input by input ([N/64][K][64]);
    zero-padded."""
    N, K = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    padded = torch.zeros(-(-N // COLS) * COLS, -(-K // pair) * pair, dtype=weight.dtype, device=weight.device)
    padded[:N, :K] = weight
    return padded.view(-1, COLS, padded.shape[1] // pair, pair).transpose(1, 2).contiguous()


class Matmul:
    """x (..., K) -> x @ weight.T (+ bias) (..., N) on the kernel, the weight (N, K) packed once (`pack`) and the bias
    kept in float32; checked here once, so that a call checks only its input."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.kernel = _kernel("linear", weight)
        self.dtype, self.packed = weight.dtype, pack(weight)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"a bias of {tuple(bias.shape)} for {self.out_features} outputs")
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.shape[-1] != self.in_features or x.device.type != "cpu":
            raise ValueError(f"this matmul takes CPU {self.dtype} rows of {self.in_features}; got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        rows = _rows(x)
        y = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        self.kernel(rows.data_ptr(), rows.stride(0), self.packed.data_ptr(),
                    0 if self.bias is None else self.bias.data_ptr(), y.data_ptr(), self.out_features, rows.shape[0],
                    self.out_features, self.in_features)
        return y.view(*x.shape[:-1], self.out_features)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention for R rows over the cache slots each sees: q (H, R, D) (any strides with the last dim unit), k and
    v (Hkv, S, D) with the same strides, each slot's D values contiguous, visible (R, S) uint8 -> (R, H * D), each
    row's softmax over its visible slots in slot order, the scale 1/sqrt(D)."""
    H, R, D = q.shape
    Hkv, S, _ = k.shape
    kernel = _kernel("attend", q, k, v)
    if v.shape != k.shape or k.shape[2] != D or v.stride() != k.stride() or k.stride()[1:] != (D, 1):
        raise ValueError(f"keys and values must be (Hkv, S, {D}) with rows of {D} contiguous; got {tuple(k.shape)} "
                         f"strides {k.stride()} and {tuple(v.shape)} strides {v.stride()}")
    if H % Hkv or D > MAX_HEAD_DIM:
        raise ValueError(f"attention over {H} heads from {Hkv} key heads of {D} (at most {MAX_HEAD_DIM}) values")
    if visible.dtype != torch.uint8 or visible.shape != (R, S) or not visible.is_contiguous():
        raise ValueError(f"visible must be a contiguous uint8 ({R}, {S}); got {visible.dtype} {tuple(visible.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    y = torch.empty(R, H * D, dtype=q.dtype, device=q.device)
    kernel(q.data_ptr(), q.stride(1), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), visible.data_ptr(), S,
           y.data_ptr(), R, H, Hkv, D)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim, in float32, cast to x's dtype before the weight."""
    kernel = _kernel("rms_norm", x, weight)
    if weight.shape != x.shape[-1:] or not weight.is_contiguous():
        raise ValueError(f"an RMSNorm weight {tuple(weight.shape)} for inputs of {x.shape[-1]}")
    rows = _rows(x)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    kernel(rows.data_ptr(), rows.stride(0), weight.data_ptr(), y.data_ptr(), y.stride(0), *rows.shape, eps)
    return y.view(x.shape)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (H, R, D) in place, a view with a unit last stride (q or k inside a projection's output), by the
    rows' cos and sin (R, D): x * cos + rotate_half(x) * sin, each step rounded to x's dtype."""
    H, R, D = x.shape
    kernel = _kernel("rotary", x, cos, sin)
    if x.stride(-1) != 1 or D % 2 or cos.numel() != R * D or sin.numel() != R * D:
        raise ValueError(f"rotary embedding of (H, R, D) = {tuple(x.shape)} (D even, unit last stride) by tables of "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    cos, sin = cos.reshape(R, D).contiguous(), sin.reshape(R, D).contiguous()
    kernel(x.data_ptr(), x.stride(1), x.stride(0), R, H, D, cos.data_ptr(), sin.data_ptr())
    return x
