"""The fast paths of the math in models/llama.py, as modules that take its modules' places: `pack_model` puts them in
(as `precision.quantize_linears` puts a `QuantizedLinear` in a linear's place), each holding the very parameters and
submodules of the module it replaces under the same names, so state dicts, the weights twins and heads share and
saved heads are unchanged.

- `PackedAttention`, `PackedMLP`: their projections as prepacked, fused matmuls (models/linear.py `PackedLinear`): on
  verispec's kernels where they run, else PyTorch's. Attention over a layout on the kernels (`VisibleSlots`,
  `SlotsLayout`) runs on them whole.
- `KernelRMSNorm`: RMSNorm on verispec's kernel.
- `PackedCausalLM`: the packed LM head, and a forward's inputs gathered by the kernels over a layout on them.

Each falls back to the plain math where its fast path does not run (outside inference mode, under autocast, over a
PyTorch layout): that decision is made here, not in llama.py. What runs on the kernels is decided once, by
`pack_block`, and declared by the packed model (`Packing`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch
from torch import nn

from verispec import kernels
from verispec.models.cache import KVCache
from verispec.models.forward_options import VocabHead
from verispec.models.layout import Layout, VisibleSlots
from verispec.models.linear import PackedLinear, packed_here
from verispec.models.llama import MLP, Attention, Block, Cache, LlamaForCausalLM, RMSNorm, Ropes
from verispec.models.slot_caches import SlotsLayout

M = TypeVar("M", bound=nn.Module)
GATED_KERNELS = {"silu": kernels.silu_mul, "gelu_pytorch_tanh": kernels.gelu_tanh_mul}  # act(gate) * up, one kernel


@dataclass(frozen=True)
class Packing:
    """What verispec's kernels run in a packed model: its matmuls, norms, rotary and residual adds (`kernels`), and its
    attention (`attention`: where they take the head size), each row over its own keys (`VisibleSlots`)."""

    kernels: bool
    attention: bool


UNPACKED = Packing(kernels=False, attention=False)  # the plain math's: nothing on verispec's kernels


def swapped(module: nn.Module, kind: type[M]) -> M:
    """`module` as a `kind` (a packed subclass of its class, or its plain class again): a new module that holds its
    very parameters, submodules and attributes under the same names, for its parent to hold in its place."""
    new = kind.__new__(kind)
    new.__dict__.update({name: copy.copy(v) if isinstance(v, (dict, set)) else v for name, v in vars(module).items()})
    return new


class KernelRMSNorm(RMSNorm):
    """RMSNorm (and the residual add) by verispec's kernel, in inference on the weight's dtype."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == self.weight.dtype and packed_here(x):
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        return super().forward(x, residual)


class PackedAttention(Attention):
    """Attention whose q, k, v run as one prepacked matmul (`qkv`) and o as another (`o`, adding the residual). Over a
    layout on verispec's kernels it runs on them whole, as rows (B = 1); elsewhere it is the plain math."""

    qkv: PackedLinear
    o: PackedLinear

    @classmethod
    def of(cls, attention: Attention, rows: int, own_kernels: bool) -> PackedAttention:
        """`attention` packed for `rows` rows (`own_kernels`: on verispec's kernels)."""
        packed = swapped(attention, cls)
        packed.qkv = PackedLinear([packed.q_proj, packed.k_proj, packed.v_proj], rows, own_kernels)
        packed.o = PackedLinear([packed.o_proj], rows, own_kernels)
        return packed

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Cache | None,
        layout: Layout | SlotsLayout,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        if layout.on_kernels:
            return self._on_kernels(x, cos, sin, cache, layout, residual)
        return super().forward(x, cos, sin, cache, layout, residual)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv.parts(x)

    def output(self, y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.o(y, residual)

    def _on_kernels(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        layout: VisibleSlots | SlotsLayout,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention on verispec's kernels, as rows (B = 1): kernel calls on views of the projections' output, the
        keys stored and attended by the layout (one sequence's cache, or each sequence's own)."""
        T, D, H, Hkv = x.shape[1], self.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(x)[0]  # (T, (H + 2 Hkv) D): q heads, k heads, v heads
        # q and k heads (H + Hkv, T, D), normed and rotated in place
        heads = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D).transpose(0, 1)
        if self.q_norm is not None:
            kernels.head_norm_(heads[:H], self.q_norm.weight, self.q_norm.eps)
            kernels.head_norm_(heads[H:], self.k_norm.weight, self.k_norm.eps)
        kernels.rotary_(heads, cos, sin)
        y = layout.store_and_attend(
            cache,
            self.layer,
            heads[:H],
            qkv[:, H * D : (H + Hkv) * D],
            qkv[:, (H + Hkv) * D :],
            self.window,
            self.scalar,
        )  # (T, H * D)
        return self.o(y[None], residual)


class PackedMLP(MLP):
    """The MLP with gate and up as one prepacked matmul (`gate_up`) and down as another (`down`, adding the residual);
    on verispec's kernels, in inference, act(gate) * up as one kernel too."""

    gate_up: PackedLinear
    down: PackedLinear

    @classmethod
    def of(cls, mlp: MLP, rows: int, own_kernels: bool) -> PackedMLP:
        """`mlp` packed for `rows` rows (`own_kernels`: on verispec's kernels)."""
        packed = swapped(mlp, cls)
        packed.gate_up = PackedLinear([packed.gate_proj, packed.up_proj], rows, own_kernels)
        packed.down = PackedLinear([packed.down_proj], rows, own_kernels)
        return packed

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.gate_up.kernel is not None and packed_here(x):
            return self.down(GATED_KERNELS[self.act](self.gate_up(x)), residual)
        return super().forward(x, residual)

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up.parts(x)

    def output(self, y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.down(y, residual)


class PackedCausalLM(LlamaForCausalLM):
    """A `LlamaForCausalLM` whose blocks are packed (`pack_model`): its LM head packed too (`head`), and `packing`,
    what runs on verispec's kernels. A forward over a layout on the kernels takes its rows of the embedding and rotary
    tables by kernels, so that nothing but kernels runs in it (models/captured.py)."""

    head: PackedLinear
    packing: Packing

    @property
    def output(self) -> nn.Module:
        return self.head

    def vocab_head(self, ids: torch.Tensor) -> VocabHead:
        plain = super().vocab_head(ids)
        return VocabHead(plain.ids, PackedLinear([plain.matmul], self.head.rows, self.packing.kernels))

    def inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor, run: Sequence[int], layout: Layout | SlotsLayout
    ) -> tuple[torch.Tensor, Ropes]:
        if not layout.on_kernels:
            return super().inputs(tokens, positions, run, layout)
        table, rows = self.model.embed_tokens, tokens[0]  # (T,): one sequence of rows (B = 1)
        lookup = getattr(
            table, "lookup", None
        )  # a table kept in blocks dequantizes its rows (quant.QuantizedEmbedding)
        x = lookup(rows, self.dtype) if lookup is not None else kernels.gather(table.weight, rows, self.dtype)
        if self.model.scale is not None:
            x = kernels.scale_(x, self.model.scale)
        ropes = {
            rope: (kernels.gather(cos, positions), kernels.gather(sin, positions))
            for rope, (cos, sin) in layout.rope.items()
        }
        return x[None], ropes  # (1, T, D)


def packing(module: nn.Module) -> Packing:
    """What verispec's kernels run in a model: as `pack_model` declared it, or nothing for the plain math."""
    return getattr(module, "packing", UNPACKED)


def pack_block(block: Block, rows: int, own_kernels: bool | None = None) -> Packing:
    """Put packed modules in a decoder block's places: its projections as prepacked matmuls laid out for `rows` rows,
    q, k, v and gate, up fused, and its norms on verispec's kernels where those run the matmuls (`own_kernels`: by
    default `kernels.available`): an inference-only fast path. Its attention runs on verispec's kernels where they
    take the head size. What it put on the kernels comes back."""
    weight = block.post_attention_layernorm.weight  # the activations' dtype (a linear may be quantized)
    if own_kernels is None:
        own_kernels = kernels.available(weight.dtype, weight.device)
    elif own_kernels and not kernels.available(weight.dtype, weight.device):
        raise ValueError(f"verispec's kernels do not run {weight.dtype} here: {kernels.reason()}")
    block.self_attn = PackedAttention.of(block.self_attn, rows, own_kernels)
    block.mlp = PackedMLP.of(block.mlp, rows, own_kernels)
    # its RMSNorms, q's and k's included (EAGLE's layer has none at its input; Gemma's, more)
    norms = [name for name, module in block.named_modules() if isinstance(module, RMSNorm)]
    for name in norms:
        parent, _, attribute = name.rpartition(".")
        owner = block.get_submodule(parent)
        setattr(owner, attribute, swapped(getattr(owner, attribute), KernelRMSNorm if own_kernels else RMSNorm))
    return Packing(own_kernels, own_kernels and block.self_attn.head_dim <= kernels.MAX_HEAD_DIM)


def pack_model(
    module: LlamaForCausalLM, rows: int, own_kernels: bool | None = None, head: PackedLinear | None = None
) -> PackedCausalLM:
    """`module` packed, to take its place: every block packed (`pack_block`), its final norm on verispec's kernels
    where they run the matmuls (`own_kernels`: by default `kernels.available`, where this machine has them), and its
    LM head as a prepacked matmul laid out for `rows` rows, or `head`, one packed already (a quantized twin's, which is
    its target's: models/twin.py). Its blocks and parameters are `module`'s own (whose blocks it packs in place:
    the packed model replaces `module`, which is not used after)."""
    param = module.model.norm.weight  # the activations' dtype (the LM head may be quantized)
    own_kernels = kernels.available(param.dtype, param.device) if own_kernels is None else own_kernels
    packings = [pack_block(block, rows, own_kernels) for block in module.model.layers]
    module.model.norm = swapped(module.model.norm, KernelRMSNorm if own_kernels else RMSNorm)
    packed = swapped(module, PackedCausalLM)
    packed.head = head or PackedLinear([module.lm_head], rows, own_kernels)
    packed.packing = Packing(own_kernels, packings[0].attention if packings else False)
    return packed
