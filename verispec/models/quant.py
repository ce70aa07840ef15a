"""The modules over block-quantized weights (checkpoints/blocks.py's `QuantizedWeight`): a linear layer and an
embedding table kept in their blocks, as `nn.Linear` and `nn.Embedding` are over float weights."""

from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels
from verispec.checkpoints.blocks import QuantizedWeight


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is kept in a block format: what `nn.Linear` is for a float weight. Packed for
    verispec's kernels (models/precision.py), it runs from its blocks; elsewhere (training, autocast) it runs on its
    weight dequantized to float32, which `weight` makes on first use."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.quantized = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @cached_property
    def weight(self) -> torch.Tensor:
        """The weight (N, K) the blocks stand for, in float32."""
        return self.quantized.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def rows(self, index: torch.Tensor) -> QuantizedLinear:
        """A linear over the outputs `index` only (an LM head over part of the vocabulary), still quantized."""
        return QuantizedLinear(self.quantized.rows(index), None if self.bias is None else self.bias[index])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.quantized.format}"


class QuantizedEmbedding(nn.Module):
    """A token embedding table kept in a block format, as a GGUF file holds it: a lookup dequantizes only the rows it
    takes (on verispec's kernels, as llama.cpp's get_rows does), so the table is never widened to float32 whole.
    Its rows are bitwise those of the whole table dequantized (`weight`, made on first use by what reads the table
    whole: training, the EAGLE heads)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.quantized = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    @cached_property
    def weight(self) -> torch.Tensor:
        """The table (vocab, D) in float32."""
        return self.quantized.dequantize()

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows (T, D) of the tokens (T,) int64, in `dtype` (float32 only: the rows' own)."""
        if dtype != torch.float32:
            raise ValueError(f"a {self.quantized.format} embedding's rows are float32; asked for {dtype}")
        return kernels.gather_blocks(self.quantized.blocks, self.quantized.format, tokens)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1).to(torch.int64).contiguous()
        return self.lookup(flat).view(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.quantized.format}"
