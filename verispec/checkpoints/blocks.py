"""Block-quantized weights in ggml's formats, kept as their blocks: what a GGUF file holds, or what `--quantize`
makes of a float checkpoint.

A `QuantizedWeight` is a linear's weight (N, K) as N rows of K / 32 blocks, each block 32 consecutive inputs of one
row, laid out byte for byte as ggml lays it out (and as a GGUF tensor's data is):
- Q8_0: d (float16), then 32 int8 q: w = d * q;
- Q4_0: d (float16), then 16 bytes, element j in byte j's low nibble and element j + 16 in its high one: w = d * (q -
8);
- Q4_1: d (float16), m (float16), then the nibbles as Q4_0: w = d * q + m;
- Q5_0, Q5_1: as Q4_0 and Q4_1 with a fifth bit for each element (w = d * (q - 16), d * q + m);
- Q4_K, Q5_K, Q6_K (a GGUF's, not made here: the `gguf` package cannot quantize to them): super-blocks of 256
  inputs, each with a float16 scale (and min) over 6- or 8-bit scales of its blocks of 32 (Q4_K, Q5_K: the 4- or
  5-bit quants as Q4_1's and Q5_1's) or 16 inputs (Q6_K).
Quantizing and dequantizing are the `gguf` package's (ggml's reference code in numpy), so a weight quantized here
has the bits llama.cpp's `llama-quantize` writes. verispec's kernels read the blocks directly (models/precision.py
packs them); elsewhere a quantized weight runs dequantized. The modules that run them are models/quant.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, dequantize, quantize

from verispec.errors import InvalidArgumentError
from verispec.kernels.quant_pack import QUANTIZED

BLOCK = 32  # inputs per block of the formats weights are quantized to here
FORMATS = {name: QUANTIZED[name] for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")}  # what --quantize makes
KEPT = QUANTIZED  # what a QuantizedWeight holds and the kernels read: FORMATS, and a GGUF's Q4_K, Q5_K, Q6_K


def check_format(name: str) -> str:
    """`name` if it is a format verispec keeps quantized, else an `InvalidArgumentError` that lists them."""
    if name not in FORMATS:
        raise InvalidArgumentError(f"unknown quantization {name!r}; choose one of {', '.join(FORMATS)}")
    return name


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight (N, K) in `format` (one of `KEPT`): `blocks` (N, K / block inputs * block bytes) uint8, ggml's
    blocks row by row."""

    format: str
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        if self.format not in KEPT:
            raise ValueError(f"no blocks of {self.format!r}; verispec keeps {', '.join(KEPT)}")
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] % self.block_bytes:
            raise ValueError(
                f"{self.format} blocks are uint8 (N, K / {self.block_inputs} * {self.block_bytes}); "
                f"got {self.blocks.dtype} {tuple(self.blocks.shape)}"
            )

    @property
    def block_inputs(self) -> int:
        return GGML_QUANT_SIZES[KEPT[self.format]][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[KEPT[self.format]][1]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): outputs and inputs, as the float weight's."""
        return self.blocks.shape[0], self.blocks.shape[1] // self.block_bytes * self.block_inputs

    @property
    def nbytes(self) -> int:
        """The bytes a forward reads of it."""
        return self.blocks.numel()

    @staticmethod
    def of(weight: torch.Tensor, format: str) -> QuantizedWeight:
        """A float weight (N, K), K a multiple of 32, quantized as llama.cpp quantizes it (from float32)."""
        check_format(format)
        if weight.dim() != 2 or weight.shape[1] % BLOCK:
            raise InvalidArgumentError(
                f"{format} quantizes rows of a multiple of {BLOCK} inputs; got a weight of {tuple(weight.shape)}"
            )
        data = quantize(weight.detach().to(torch.float32).cpu().numpy(), FORMATS[format])
        return QuantizedWeight(format, torch.from_numpy(np.ascontiguousarray(data)))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (N, K) it stands for, in float32 (exact: every format's values are float32 numbers), then cast."""
        values = dequantize(self.blocks.numpy(), KEPT[self.format])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows (outputs) `index` of it, in that order, still quantized (a row is whole blocks)."""
        return QuantizedWeight(self.format, self.blocks[index].contiguous())
