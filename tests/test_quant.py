"""Block-quantized weights: ggml's formats, quantized and dequantized as the gguf package (ggml's reference) does."""

import gguf
import numpy as np
import pytest
import torch

from verispec.checkpoints.blocks import FORMATS, QuantizedWeight
from verispec.errors import InvalidArgumentError


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_weight_quantizes_to_ggmls_blocks_and_back(fmt):
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    q = QuantizedWeight.of(weight, fmt)
    data = gguf.quants.quantize(weight.numpy(), FORMATS[fmt])
    assert np.array_equal(q.blocks.numpy(), data)  # ggml's bytes
    assert q.shape == (48, 96) and q.nbytes == data.nbytes
    values = q.dequantize()
    assert np.array_equal(values.numpy(), gguf.quants.dequantize(data, FORMATS[fmt]))
    # a block's scale over its largest value
    step = {"q8_0": 1 / 127, "q4_0": 1 / 7, "q4_1": 1 / 15, "q5_0": 1 / 15, "q5_1": 1 / 31}[fmt]
    assert (values - weight).abs().max() <= step * weight.abs().max()
    assert torch.equal(q.rows(torch.tensor([5, 0, 47])).dequantize(), values[[5, 0, 47]])
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_bad_formats_and_shapes_are_refused():
    with pytest.raises(InvalidArgumentError, match="unknown quantization 'q6_k'"):
        QuantizedWeight.of(torch.zeros(4, 256), "q6_k")
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        QuantizedWeight.of(torch.zeros(4, 40), "q8_0")
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("q8_0", torch.zeros(4, 35, dtype=torch.uint8))
