"""verispec's own CPU kernels: a weight-streaming matmul (matmul.py), attention over each row's visible keys (or the
last of them: a sliding window) and new keys into the cache (attention.py), the row-wise work around them (rows.py:
RMSNorm of rows or heads, rotary, silu(gate) * up and gelu(gate) * up, scaled rows, embedding and rotary rows by
index), a causal forward's positions and visible slots, the argmax and a greedy chain's
step to its next token (tokens.py), so that a forward on them, and a decoding step around it, is nothing but kernel
calls and can be captured and replayed (capture.py). calls.py is how each wrapper calls its kernel.

Each gives a row the same bits whatever else shares the call (see simd.h), and the matmul streams its packed weight
once a call for all the rows decoding sends it, so a step costs about one read of the weights
(docs/bench/forward-profile.md measures it). They run on their own pool of threads (pool.cpp), which splits each call
over output columns, heads or rows, never over a sum, so a row's bits are the same at any thread count;
`verispec.set_threads` sets the count. `available` says whether this machine has them (build.py builds them at first
use). The wrappers check what the C code cannot (dtypes, shapes, strides) and raise ValueError: a wrong call must
never read out of bounds.
"""

from __future__ import annotations

from verispec.kernels.attention import MAX_HEAD_DIM, attend, store_kv
from verispec.kernels.build import isa, reason
from verispec.kernels.calls import address, available
from verispec.kernels.capture import NotCapturable, Program, capturing
from verispec.kernels.matmul import Matmul, pack, pack_quantized
from verispec.kernels.quant_pack import QUANTIZED
from verispec.kernels.rows import (
    TABLES,
    gather,
    gather_blocks,
    gelu_tanh_mul,
    head_norm_,
    rms_norm,
    rotary_,
    scale_,
    silu_mul,
)
from verispec.kernels.tokens import argmax, causal_rows, next_token, program, run

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
