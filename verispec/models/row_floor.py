"""Exact mode's row floor: the fewest rows a forward runs, measured once per model on this machine's kernels.

Exact mode needs a position's logits to be bitwise the same however many tokens share the forward. Padding every
forward to the same 16 rows makes that so by construction, but a 1-token step then pays for 16 rows: in bfloat16
on this project's Zen 4 (no AMX) 12.6 ms instead of 9.7. The row count matters only where a kernel picks its code
path by it: the matmuls. (Norms, rotary, softmax and the elementwise ops reduce within a row, the same code for
every row whatever their number; the attention's score matmul runs at the fixed 16 rows anyway, see `Rows.attend`.)
Those kernels mostly do not change path between 1 and 16 rows, but some do: oneDNN's bfloat16 matmul over 1,408
inputs (the MLP's down projection) gives one row other bits than 2 to 16 rows do, on about 8% of rows, and float32
matmuls take another path below 4 rows.

So at load, each such kernel of the model (every distinct projection of a block, the LM head, and the attention's
two matmuls over values) runs on SAMPLES random rows at every count from 1 to `rows` and is compared bitwise with
its result at `rows` rows; the floor is one more than the largest count that gave any row other bits (1 when none
did). A forward then runs its real rows, padded up to the floor: a row's result is the same at every count from the
floor to `rows`. Kernels are checked with the model's own weights and the projections' own call paths (packed or
plain), so what is checked is what runs.
"""

from __future__ import annotations

from typing import Callable

import torch

from verispec.models.llama import TAIL

SAMPLES = 96  # rows checked per count: a kernel that changes a row's bits on 1% of rows shows with p > 0.6 at
# every count, and the real one found (8% of rows) with p > 0.9999


@torch.inference_mode()  # where the packed kernels run (models/linear.py)
def row_floor(module: torch.nn.Module, rows: int, width: int, samples: int = SAMPLES) -> int:
    """The least row count r such that every matmul of `module`'s forward (a `LlamaForCausalLM`) gives each row
    the same bits at every count from r to `rows`; `width` is the exact cache's key width."""
    generator = torch.Generator().manual_seed(0)
    floor = 1
    for run in _kernels(module, width, samples, generator):
        floor = max(floor, 1 + _largest_differing_count(run, samples, rows))
    return floor


def _largest_differing_count(run: Callable[[int, int], torch.Tensor], samples: int, rows: int) -> int:
    """The largest count m < rows at which running the sample rows m at a time gives some row other bits than
    running them `rows` at a time (0: none). Every call runs exactly m rows: the rows past the last whole chunk
    are left out."""
    def in_chunks(m: int) -> torch.Tensor:
        return torch.cat([run(i, i + m) for i in range(0, samples - m + 1, m)])

    if samples % rows:
        raise ValueError(f"{samples} sample rows are not whole chunks of {rows}")
    reference = in_chunks(rows)
    for m in range(rows - 1, 0, -1):
        out = in_chunks(m)
        if not torch.equal(out, reference[: len(out)]):
            return m
    return 0


def _kernels(module: torch.nn.Module, width: int, samples: int,
             generator: torch.Generator) -> list[Callable[[int, int], torch.Tensor]]:
    """Each row-count-sensitive kernel of the forward as `run(lo, hi)`: its output for sample rows lo..hi-1, run
    together in one call, as the forward calls it."""
    param = next(module.parameters())
    dtype, device = param.dtype, param.device

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    block, kernels = module.model.layers[0], []
    attention, mlp = block.self_attn, block.mlp
    linears = [attention.qkv, attention.o, mlp.gate_up, mlp.down, module.head]
    if any(linear is None for linear in linears):  # not packed: the plain projections run
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj, module.lm_head]
    for linear in linears:
        x = randn(1, samples, linear.linears[0].in_features if hasattr(linear, "linears") else linear.in_features)
        kernels.append(lambda lo, hi, linear=linear, x=x: linear(x[:, lo:hi])[0])
    # The attention's matmuls (see Rows.attend): float32 scores, queries (Hkv, R * G, D) @ keys (Hkv, D, S) for S
    # up to W; probabilities (Hkv, R * G, W) @ values (Hkv, W, D) for the prefix; and per row (Hkv, R, G, TAIL) @
    # (Hkv, R, TAIL, D) for the gathered tail.
    heads, kv_heads, dim = attention.heads, attention.kv_heads, attention.head_dim
    group, tail = heads // kv_heads, TAIL
    for span in sorted({*range(64, width + 1, 64), width}):  # the key counts a score matmul runs at (Rows.span)
        q, keys = randn(samples, kv_heads, group, dim).float(), randn(kv_heads, dim, span).float()
        kernels.append(lambda lo, hi, q=q, keys=keys: (q[lo:hi].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim) @ keys)
                       .view(kv_heads, hi - lo, group, -1).transpose(0, 1))
    p, values = randn(samples, kv_heads, group, width).softmax(-1), randn(kv_heads, width, dim)
    kernels.append(lambda lo, hi: (p[lo:hi].permute(1, 0, 2, 3).reshape(kv_heads, -1, width) @ values)
                   .view(kv_heads, hi - lo, group, dim).transpose(0, 1))
    p_tail, v_tail = randn(kv_heads, samples, group, tail).softmax(-1), randn(kv_heads, samples, tail, dim)
    kernels.append(lambda lo, hi: (p_tail[:, lo:hi] @ v_tail[:, lo:hi]).transpose(0, 1))
    return kernels
