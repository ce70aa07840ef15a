"""How a forward runs: the one place that decides it. The math (models/llama.py) runs over whatever layout it is
given; this module picks the layout and the path:

- a decoding step on verispec's kernels whose shape was captured: a replay, with next to no Python (`replay_causal`);
- one sequence into a cache on verispec's kernels: `VisibleSlots`, captured once per shape and replayed after
  (models/captured.py), or op by op with capture off;
- into a static cache (exact mode): chunks of rows, on PyTorch's kernels each padded to the chunk's full row count;
- otherwise PyTorch's scaled_dot_product_attention over a mask (`AttentionMask`), a batch of sequences included.

`Execution` holds what runs a model's forwards keep between calls: its captures and rotary table.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from verispec.models.batch_cache import BatchLayout
from verispec.models.cache import KVCache
from verispec.models.captured import lookup, replay, replay_causal, replay_chain
from verispec.models.forward_options import ForwardOptions, VocabHead
from verispec.models.greedy import argmax
from verispec.models.layout import (
    AttentionMask,
    Layout,
    Rope,
    Table,
    VisibleSlots,
    as_index,
    covering_all,
    exact_layout,
    visible_slots,
)
from verispec.models.linear import packed_here
from verispec.models.llama import LlamaForCausalLM
from verispec.models.packed import packing
from verispec.models.slot_caches import SlotsLayout

LONG_ROWS = 256  # exact mode's chunks on verispec's attention, where they bound only memory (see `_exact`)
Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # logits, and (B, T, len(hidden), D) where asked for


class Execution:
    """Runs the forwards of one `LlamaForCausalLM`, packed as it will stay (models/packed.py)."""

    def __init__(self, module: LlamaForCausalLM) -> None:
        self.module = module
        self.kernel_attention = packing(module).attention  # attention on verispec's kernels (`VisibleSlots`)
        self.capture = True  # replay a `VisibleSlots` forward's captured kernel calls; False: op by op
        self.captured: dict = {}  # those captures by shape (models/captured.py `replay`)
        self.rope: dict[Rope, Table] | None = None  # cos, sin by position for each RoPE, for `VisibleSlots`

    def forward(
        self, tokens: torch.Tensor, cache: KVCache | None, options: ForwardOptions = ForwardOptions()
    ) -> Result:
        """Logits (B, T - options.logits_from, V) for T new tokens (B, T) stored after the cache's `length`
        positions (see `ForwardOptions`), and the hidden states it asks for.

        Into a static cache (`cache.rows` set: exact mode) a forward runs in chunks (of `cache.rows` rows, or
        `LONG_ROWS` on verispec's attention), each padded up to `row_floor` rows, so that a position's logits are
        bitwise the same however many tokens share the forward; a chunk sees earlier chunks through the cache, so
        no token may see a later chunk's.
        """
        T = tokens.shape[1]
        start = 0
        if cache is not None:
            cache.reserve(T)
            start = cache.length
        if options.mask is None and options.positions is None and self._captured(tokens, cache):  # a decoding step
            capture = lookup(self.captured, self._key(T, options, cache))
            if capture is not None:
                logits, states = replay_causal(capture, cache, tokens)
                cache.advance(T)
                return _result(logits, states, options)
        if options.positions is None:
            options = replace(options, positions=torch.arange(start, start + T, device=tokens.device))
        if cache is not None and cache.rows is not None:
            return self._exact(tokens, cache, options)
        if cache is None:
            layout = AttentionMask(options.mask, causal=options.mask is None)
        elif self._on_kernels(tokens, cache):  # each row over its own keys
            layout = VisibleSlots.of(visible_slots(options.mask, T, start, cache.slots, torch.uint8, tokens.device))
        else:
            layout = AttentionMask.over_cache(options.mask, T, start, tokens.device)
        out = self._run(tokens, cache, layout, options)
        if cache is not None:
            cache.advance(T)
        return out

    def forward_batch(
        self, tokens: torch.Tensor, rows: BatchLayout | SlotsLayout, head: VocabHead | None = None, logits: bool = True
    ) -> torch.Tensor | None:
        """Logits (B, T, V) for a batch of sequences, row b continuing its own cache slot (each row's offset, its real
        tokens and its padding); each slot advances by its row's real tokens only. `head`: over its tokens only (B, T,
        N); without `logits`, no LM head (None). On verispec's kernels (`SlotsLayout`) only the real tokens run, as one
        sequence of rows each attending over its own cache: a row's logits are then bitwise its sequence's alone; a
        padding row's are zeros."""
        if rows.on_kernels:
            self.rope = covering_all(self.rope, rows.slots, self.module.config, self.module.dtype)
            real = tokens[rows.real][None]
            out, _ = self.module(
                real,
                None,
                replace(rows, rope=self.rope),
                ForwardOptions(positions=rows.positions, head=head, logits_from=0 if logits else real.shape[1]),
            )
            rows.advance()
            if not logits:
                return None
            padded = out.new_empty(*tokens.shape, out.shape[-1])
            padded[rows.real], padded[~rows.real] = out[0], 0
            return padded
        out, _ = self.module(
            tokens,
            rows,
            AttentionMask(rows.mask),
            ForwardOptions(positions=rows.positions, head=head, logits_from=0 if logits else tokens.shape[1]),
        )
        rows.advance()
        return out if logits else None

    def chain(
        self, tokens: torch.Tensor, cache: KVCache, n: int, vocab: int, head: VocabHead | None = None
    ) -> list[int]:
        """n tokens of greedy decoding after `tokens` (1, T), each the argmax of the first `vocab` logits after the one
        before (with `head`, of its logits, over its tokens: a drafter's reduced vocabulary): a forward of the T
        tokens, then n - 1 forwards of one token, the cache T + n - 1 longer. On verispec's kernels, once both shapes
        are captured (a forward of T tokens whose last row's logits are kept, and one of a token), the chain runs
        them as one program, each argmax made the next forward's input by a kernel (models/captured.py
        `replay_chain`); until then, and elsewhere, a forward at a time (which captures them). A prompt (more than
        two tokens) runs as an ordinary forward (in chunks in exact mode) and the chain from its last token. If a
        chain fails, the cache is left as it was."""
        cache.reserve(tokens.shape[1] + n - 1)
        start = cache.length
        try:
            replaying = self._captured(tokens, cache)
            if replaying and tokens.shape[1] > 2:
                self.forward(tokens[:, :-1], cache, ForwardOptions(logits_from=tokens.shape[1] - 2))
                tokens = tokens[:, -1:]
            T, ids = tokens.shape[1], None if head is None else head.ids
            vocab = vocab if head is None else len(ids)
            first = (
                lookup(self.captured, self._key(T, ForwardOptions(logits_from=T - 1, head=head), cache))
                if replaying
                else None
            )
            step = (
                first
                if T == 1
                else lookup(self.captured, self._key(1, ForwardOptions(head=head), cache))
                if replaying
                else None
            )
            if first is None or step is None:
                out, x = [], tokens
                while len(out) < n:
                    options = ForwardOptions(logits_from=x.shape[1] - 1, head=head)
                    best = int(argmax(self.forward(x, cache, options)[0, -1, :vocab]))
                    out.append(best if ids is None else int(ids[best]))
                    x = torch.tensor([out[-1:]], device=tokens.device)
                return out
            return replay_chain(first, step, cache, tokens, n, vocab, ids)
        except BaseException:
            cache.truncate(start)  # as if the chain never ran
            raise

    def row_floor(self, rows: int) -> int:
        """The fewest rows an exact-mode forward (chunks of at most `rows`) runs, padding where it has fewer: 1 on
        verispec's kernels, which give a row the same bits at any count by construction (verispec/kernels); `rows`
        on PyTorch's, whose kernels may pick their code path by the row count (oneDNN's bfloat16 matmul over some
        widths, the float32 score matmul below 4 rows, an elementwise loop's vector tail) but, at one fixed count,
        give a row the same bits whatever the other rows hold. No measuring, so no calibration at load."""
        return 1 if self.kernel_attention else rows

    def _on_kernels(self, tokens: torch.Tensor, cache: KVCache | None) -> bool:
        """Whether a forward of `tokens` into `cache` attends through verispec's kernels, each row over its own keys
        (`VisibleSlots`): one sequence into a cache, in inference."""
        return self.kernel_attention and cache is not None and tokens.shape[0] == 1 and packed_here(tokens)

    def _captured(self, tokens: torch.Tensor, cache: KVCache | None) -> bool:
        """Whether a forward of `tokens` into `cache` runs as captured programs: `VisibleSlots`, with capture on."""
        return self.capture and self._on_kernels(tokens, cache)

    def _key(self, T: int, options: ForwardOptions, cache: KVCache) -> tuple:
        """A `VisibleSlots` forward's shape, by which it is captured: rows, logits from row `logits_from`, blocks
        run, states asked for, the cache's layout, the LM head."""
        run = self.module.blocks(options.layers)
        return (
            T,
            options.logits_from,
            tuple(run),
            tuple(options.hidden or ()),
            tuple(cache.k.shape),
            cache.k.dtype,
            options.head,
        )

    def _run(self, tokens: torch.Tensor, cache: KVCache | None, layout: Layout, options: ForwardOptions) -> Result:
        """The module's forward over `layout`; on verispec's kernels, with capture on, captured once per shape and
        replayed (nothing but kernels runs in it)."""
        if not layout.on_kernels:
            return _result(*self.module(tokens, cache, layout, options), options)
        self.rope = covering_all(self.rope, cache.slots, self.module.config, self.module.dtype)
        layout, options = replace(layout, rope=self.rope), replace(options, positions=as_index(options.positions))
        if not self.capture:
            return _result(*self.module(tokens, cache, layout, options), options)
        logits, states = replay(
            self.captured,
            self._key(tokens.shape[1], options, cache),
            cache,
            lambda t, p, rows: self.module(t, cache, rows, replace(options, positions=p)),
            (tokens, options.positions),
            layout,
            prefill=options.logits_from > 0,
        )
        return _result(logits, states, options)

    def _exact(self, tokens: torch.Tensor, cache: KVCache, options: ForwardOptions) -> Result:
        """The forward into a static cache, logits from row `options.logits_from` on: chunks of at most R rows, each
        padded to `row_floor` rows and laid out by `exact_layout`. On verispec's attention (row floor 1) a row's result
        does not depend on the rows beside it, so chunks only bound memory: they are `LONG_ROWS` long, and a prefill
        streams the weights far less often than in chunks of `cache.rows`."""
        B, T = tokens.shape
        if B != 1:
            raise ValueError(f"exact mode runs one sequence at a time; got a batch of {B}")
        start, slots, device = cache.length, cache.slots, tokens.device
        on_kernels = self.kernel_attention
        floor = self.row_floor(cache.rows)
        R = LONG_ROWS if on_kernels else cache.rows
        # (T, P) the cache slots each token sees, as `VisibleSlots` takes them (uint8) or `FixedWidthKeys` (bool)
        visible = visible_slots(options.mask, T, start, slots, torch.uint8 if on_kernels else torch.bool, device)
        if T > R and any(visible[c : c + R, start + c + R :].any() for c in range(0, T - R, R)):
            raise ValueError(f"exact mode runs {T} tokens as chunks of {R}; a token here sees a later chunk's")
        logits, states = [], []
        try:
            for c in range(0, T, R):
                n = min(R, T - c)
                m = max(n, floor)  # the rows run
                rows, x, where = visible[c : c + n], tokens[:, c : c + n], options.positions[c : c + n]
                if n < floor:
                    # Padding rows (token 0 at position 0) see slot 0 only: any finite result will do, as they are
                    # written past the real rows, where no real row looks.
                    rows = torch.cat((rows, torch.zeros(floor - n, slots, dtype=rows.dtype, device=device)))
                    rows[n:, 0] = True
                    x, where = F.pad(x, (0, floor - n)), F.pad(where, (0, floor - n))
                first = min(max(options.logits_from - c, 0), n)  # the chunk's first row whose logits are asked for
                if first == n:
                    first = m  # none: the LM head is skipped
                elif floor > 1:
                    first = 0  # a padded chunk's head runs over all its rows: always the same count
                out = self._run(
                    x,
                    cache,
                    exact_layout(on_kernels, rows, cache.width),
                    replace(options, positions=where, logits_from=first),
                )
                out = (out, None) if options.hidden is None else out
                logits.append(out[0][:, : max(n - first, 0)])
                states.append(None if options.hidden is None else out[1][:, :n])
                cache.advance(n)
        except BaseException:
            cache.truncate(start)  # as if the forward never ran
            raise
        logits = logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)
        logits = logits[:, logits.shape[1] - (T - options.logits_from) :]  # a padded chunk's head ran from row 0
        if options.hidden is None:
            return logits
        return logits, states[0] if len(states) == 1 else torch.cat(states, dim=1)


def _result(logits: torch.Tensor, states: list[torch.Tensor], options: ForwardOptions) -> Result:
    """The logits, and the hidden states stacked (B, T, len(hidden), D) where they were asked for."""
    return logits if options.hidden is None else (logits, torch.stack(states, dim=2))
