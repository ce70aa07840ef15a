"""The block formats the quantized matmul reads (ggml's) and the sizes of their blocks, as ggml keeps them and as
kernels.pack_quantized packs them (kernels/pack.cpp; quant.cpp's header gives the layout)."""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML

QUANT_COLS = 16  # output columns per packed block (quant.cpp QCOLS)
# Each format the matmul reads, as ggml's type: its blocks' inputs and bytes (gguf.GGML_QUANT_SIZES). The order is
# pack.cpp's `Format`.
QUANTIZED = {
    "q8_0": GGML.Q8_0,
    "q4_0": GGML.Q4_0,
    "q4_1": GGML.Q4_1,
    "q5_0": GGML.Q5_0,
    "q5_1": GGML.Q5_1,
    "q4_k": GGML.Q4_K,
    "q5_k": GGML.Q5_K,
    "q6_k": GGML.Q6_K,
}


def inputs_per_block(format: str) -> int:
    """Inputs per ggml block of `format`: 32, or 256 for a K-quant."""
    return GGML_QUANT_SIZES[QUANTIZED[format]][0]


def bytes_per_block(format: str) -> int:
    """Bytes per ggml block of `format`."""
    return GGML_QUANT_SIZES[QUANTIZED[format]][1]


def packed_bytes(format: str) -> int:
    """Bytes per packed block of `format` (16 columns' ggml blocks): their bytes, rearranged, but for Q4_K's and
    Q5_K's 12 bytes of 6-bit scales and mins, unpacked into 16."""
    return QUANT_COLS * (bytes_per_block(format) + (4 if format in ("q4_k", "q5_k") else 0))
