"""Exact mode's row floor: the fewest rows a forward runs, measured once per model on this machine's kernels.

Exact mode needs a position's logits to be bitwise the same however many tokens share the forward. Padding every
forward to the same 16 rows makes that so by construction, but a 1-token step then pays for 16 rows: in bfloat16
on this project's Zen 4 (no AMX) 13.9 ms instead of 10.0. The row count matters only where a kernel picks its code
path by it: the matmuls, in the projections and in the attention. (Norms, rotary, softmax and the elementwise ops
reduce within a row, the same code for every row whatever their number.) They mostly keep one path from 1 to 16
rows, but some do not: here oneDNN's bfloat16 matmul over 1,408 inputs (the MLP's down projection) gives one row
other bits than 2 to 16 rows do, on about 8% of rows, and the float32 score matmul against transposed keys takes
another path below 4 rows, on a third of the scores.

So at load, each row-count-sensitive piece of the model's forward (every distinct projection of a block, the LM
head, and the exact attention, `Rows.attend`) runs on SAMPLES random rows at every count from 1 to `rows`, and its
result is compared bitwise with the result at `rows` rows; the floor is one more than the largest count that gave
any row other bits (1 when none did). A forward then runs its real rows, padded up to the floor, so a row's result is
the same at every count it runs at. The pieces run as the forward runs them: the model's own weights and call paths
(packed or plain), the attention's own code on a cache-shaped layout, and inputs over a wide range of magnitudes, so
that sums round (an accumulation order that differs then shows; with plain normal bfloat16 values the float32 score
sums are exact in any order and hide it).
"""

from __future__ import annotations

from typing import Callable

import torch

from verispec.models.llama import Rows

SAMPLES = 96  # rows checked per count: a kernel that changes a row's bits on 1% of rows shows with p > 0.6 at
# every count, and the real one found (8% of rows) with p > 0.9999


@torch.inference_mode()  # where the packed kernels run (models/linear.py)
def row_floor(module: torch.nn.Module, rows: int, width: int, samples: int = SAMPLES) -> int:
    """The least row count r such that every matmul of `module`'s forward (a `LlamaForCausalLM`) gives each row
    the same bits at every count from r to `rows`; `width` is the exact cache's key width."""
    generator = torch.Generator().manual_seed(0)
    floor = 1
    for run in _kernels(module, rows, width, samples, generator):
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


def _kernels(module: torch.nn.Module, rows: int, width: int, samples: int,
             generator: torch.Generator) -> list[Callable[[int, int], torch.Tensor]]:
    """Each row-count-sensitive kernel of the forward as `run(lo, hi)`: its output for sample rows lo..hi-1, run
    together in one call, as the forward calls it."""
    param = next(module.parameters())
    dtype, device = param.dtype, param.device

    def randn(*shape: int) -> torch.Tensor:  # over a wide range of magnitudes, so that sums round (a reduction
        # order that differs then shows in the result)
        x = torch.randn(*shape, generator=generator) * torch.randn(*shape, generator=generator).exp()
        return x.to(device=device, dtype=dtype)

    block, kernels = module.model.layers[0], []
    attention, mlp = block.self_attn, block.mlp
    linears = [attention.qkv, attention.o, mlp.gate_up, mlp.down, module.head]
    if any(linear is None for linear in linears):  # not packed: the plain projections run
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj, module.lm_head]
    for linear in linears:
        x = randn(1, samples, linear.weight.shape[-1])
        kernels.append(lambda lo, hi, linear=linear, x=x: linear(x[:, lo:hi])[0])
    # The attention itself (Rows.attend, the code the forward runs, on the cache's layout): random queries, each
    # sample row seeing its own number of the cache's random keys and values.
    heads, kv_heads, dim = attention.heads, attention.kv_heads, attention.head_dim
    q, k, v = randn(1, heads, samples, dim), randn(1, kv_heads, width, dim), randn(1, kv_heads, width, dim)
    seen = torch.randint(1, width - rows + 1, (samples, 1), generator=generator)  # keys each row sees
    visible = (torch.arange(width)[None] < seen).to(device)
    kernels.append(lambda lo, hi: Rows.of(visible[lo:hi], width).attend(q[:, :, lo:hi], k, v)[0].transpose(0, 1))
    return kernels
