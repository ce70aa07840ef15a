"""Where a model's weights are packed for the kernels that run them, by precision (float32, bfloat16; the
block-quantized formats come here too): the projections and LM head as prepacked, fused matmuls (models/linear.py),
and which of the model's pieces then run on verispec's kernels. The parameters keep their names and values."""

from __future__ import annotations

from torch import nn

from verispec import kernels
from verispec.models.linear import PackedLinear


def pack_block(block: nn.Module, rows: int, own_kernels: bool | None = None) -> None:
    """Run a decoder block's projections as prepacked matmuls laid out for `rows` rows, q, k, v and gate, up fused
    (`own_kernels`: verispec's, by default `kernels.chosen`): an inference-only fast path. Its attention runs on
    verispec's kernels (`own_attention`) where they take the head size."""
    attention, mlp = block.self_attn, block.mlp
    weight = attention.o_proj.weight
    if own_kernels is None:
        own_kernels = kernels.chosen(weight.dtype, weight.device)
    elif own_kernels and not kernels.available(weight.dtype, weight.device):
        raise ValueError(f"verispec's kernels do not run {weight.dtype} here: {kernels.reason()}")
    attention.own_attention = own_kernels and attention.head_dim <= kernels.MAX_HEAD_DIM
    for norm in (block.input_layernorm, block.post_attention_layernorm):
        if hasattr(norm, "own_kernel"):  # EAGLE's layer has no norm at its input
            norm.own_kernel = own_kernels
    attention.qkv = PackedLinear([attention.q_proj, attention.k_proj, attention.v_proj], rows, own_kernels)
    attention.o = PackedLinear([attention.o_proj], rows, own_kernels)
    mlp.gate_up = PackedLinear([mlp.gate_proj, mlp.up_proj], rows, own_kernels)
    mlp.down = PackedLinear([mlp.down_proj], rows, own_kernels)


def pack_model(module: nn.Module, rows: int, own_kernels: bool | None = None) -> None:
    """Run every projection and the LM head of a `LlamaForCausalLM` as prepacked matmuls laid out for `rows` rows
    (see `pack_block`). `own_kernels` (by default `kernels.chosen`: where this machine has them and torch runs one
    thread): verispec's kernels run the matmuls, norms, rotary and, where they take the head size, attention."""
    param = module.lm_head.weight
    module.own_kernels = kernels.chosen(param.dtype, param.device) if own_kernels is None else own_kernels
    for block in module.model.layers:
        pack_block(block, rows, module.own_kernels)
    module.own_attention = module.model.layers[0].self_attn.own_attention if module.model.layers else False
    module.model.norm.own_kernel = module.own_kernels
    module.head = PackedLinear([module.lm_head], rows, module.own_kernels)
