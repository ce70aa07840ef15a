"""Exact mode's row floor: the fewest rows a forward runs, measured on this machine's kernels.

Exact mode needs a position's logits to be bitwise the same however many tokens share the forward. On verispec's
own kernels (verispec/kernels) that holds by construction and the floor is 1, unmeasured at load (the tests measure
it). On PyTorch's kernels, padding every forward to the same 16 rows makes it so, but a 1-token step then pays for
16 rows, at a visible share of its time in bfloat16. What the row count can change is a kernel's code path:
oneDNN's bfloat16 matmul over 1,408 inputs (the MLP's down projection) gives one row other bits than 2 to 16 rows
do, the float32 score matmul against transposed keys takes another path below 4 rows, and an elementwise kernel over
a contiguous (rows x width) tensor ends its vector loop elsewhere when the width is not a multiple of the vector.

So the floor is measured on the forward's own pieces, run as the forward runs them: a whole decoder block (its
norms, projections, rotary, exact attention over a scratch static cache, activation; every block has the same shapes
and code), and the final norm with the LM head. Each runs a chain of CHAIN positions at every span class of the
cache (the attention's key count, a multiple of 64, decides some paths), first 16 rows at a time and then m at a
time for m = 15 .. 1, and is compared bitwise; the floor is one more than the largest m that gave any row other
bits (1 when none did). Inputs span a wide range of magnitudes, so that sums round and an accumulation order that
differs shows (with plain normal bfloat16 values the float32 score sums are exact in any order and hide it). A
forward then runs its real rows padded up to the floor. It is a measurement, not a proof, and it holds for the
thread count it was taken at, so a model's forwards keep one per thread count (see `Execution.row_floor`).
"""

from __future__ import annotations

from typing import Callable

import torch

from verispec.models.cache import KVCache
from verispec.models.layout import exact_layout, rotary

CHAIN = 32  # positions per span class: whole chunks of 16, and of every m at least once


@torch.inference_mode()  # where the packed kernels run (models/linear.py)
def row_floor(module: torch.nn.Module, rows: int, width: int) -> int:
    """The least row count r such that `module`'s forward (a `LlamaForCausalLM`) gives each position the same bits
    at every count from r to `rows`, into a static cache `width` keys wide."""
    generator = torch.Generator().manual_seed(0)
    floor = 1
    for run in [*_block_chains(module, rows, width, generator), _head(module, generator)]:
        floor = max(floor, 1 + largest_differing_count(run, CHAIN, rows, floor))
    return floor


def largest_differing_count(run: Callable[[int, int], torch.Tensor], samples: int, rows: int,
                            floor: int = 1) -> int:
    """The largest count m in [floor, rows) at which running the sample rows m at a time, in order, gives some row
    other bits than running them `rows` at a time (0: none). Every call runs exactly m rows: the rows past the last
    whole chunk are left out."""
    def in_chunks(m: int) -> torch.Tensor:
        return torch.cat([run(i, i + m) for i in range(0, samples - m + 1, m)])

    if samples % rows:
        raise ValueError(f"{samples} sample rows are not whole chunks of {rows}")
    reference = in_chunks(rows)
    for m in range(rows - 1, floor - 1, -1):
        out = in_chunks(m)
        if not torch.equal(out, reference[: len(out)]):
            return m
    return 0


def _wide(generator: torch.Generator, like: torch.Tensor, *shape: int) -> torch.Tensor:
    """Random values over a wide range of magnitudes, in `like`'s dtype and device."""
    x = torch.randn(*shape, generator=generator) * torch.randn(*shape, generator=generator).exp()
    return x.to(device=like.device, dtype=like.dtype)


def _block_chains(module: torch.nn.Module, rows: int, width: int,
                  generator: torch.Generator) -> list[Callable[[int, int], torch.Tensor]]:
    """The first block over a chain of CHAIN positions ending at each span class, as `run(lo, hi)`: its output for
    chain rows lo..hi-1 in one forward, after rows 0..lo-1 (run first, in order) and a random cached prefix."""
    config, param = module.config, next(module.parameters())
    heads, dim = config.num_key_value_heads, config.dim_per_head
    last = width - rows  # the last position a token may take: the rest of the cache is a chunk's padding
    ends = sorted({min(end, last) for end in range(64, width + 64, 64)})
    runs = []
    for end in ends:
        start = max(0, end - CHAIN)
        cache = KVCache(1, 1, heads, last, dim, param.dtype, param.device, rows=rows, width=width)
        cache.k[:, :, :, :start] = _wide(generator, param, 1, 1, heads, start, dim)
        cache.v[:, :, :, :start] = _wide(generator, param, 1, 1, heads, start, dim)
        cache.advance(start)
        x = _wide(generator, param, 1, CHAIN, config.hidden_size)
        runs.append(lambda lo, hi, start=start, cache=cache, x=x: _chain_rows(module, cache, x, start, lo, hi))
    return runs


def _chain_rows(module: torch.nn.Module, cache: KVCache, x: torch.Tensor, start: int, lo: int, hi: int
                ) -> torch.Tensor:
    """Rows lo..hi-1 of the chain at start + lo.., through the block in one forward, as exact mode lays them out
    (models/execution.py)."""
    if lo == 0:
        cache.truncate(start)
    positions = torch.arange(start + lo, start + hi, device=x.device)
    visible = torch.arange(cache.slots, device=x.device)[None] <= positions[:, None]  # each row: itself and before
    cos, sin = rotary(positions, module.config.dim_per_head, module.config.rope_theta, x.dtype)
    out = module.model.layers[0](x[:, lo:hi], cos, sin, cache, exact_layout(module.own_attention, visible, cache.width))
    cache.advance(hi - lo)
    return out[0]


def _head(module: torch.nn.Module, generator: torch.Generator) -> Callable[[int, int], torch.Tensor]:
    """The final norm and the LM head (packed or plain), as the forward calls them, over CHAIN random rows."""
    param = next(module.parameters())
    x = _wide(generator, param, 1, CHAIN, module.config.hidden_size)
    lm_head = module.head or module.lm_head
    return lambda lo, hi: lm_head(module.model.norm(x[:, lo:hi]))[0]
