"""Block-quantized weights on verispec's kernels (kernels/quant.cpp): ggml's math, a row's bits its own, and models
kept quantized (`load_model(quantize=)`, models/precision.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quantize

from tests import quant_pack_reference
from tests.gguf_files import random_blocks
from verispec import kernels
from verispec.bench.bandwidth import weight_bytes
from verispec.checkpoints.blocks import FORMATS, KEPT, QuantizedWeight
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.errors import InvalidArgumentError
from verispec.kernels.quant_pack import bytes_per_block
from verispec.models.linear import FormatRuns
from verispec.models.native import load_model
from verispec.models.packed import packing
from verispec.models.quant import QuantizedLinear
from verispec.threads import torch_threads

needs_kernels = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine (tests/test_pool.py takes every count)."""


def ggml_math(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ w.T in float64 as the kernel defines it: x's rows quantized by blocks of 32 (q = round(x / d) to the
    nearest integer, ties to even, d = max |x| / 127), then against the weight's values."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d).view(x.shape).double() @ weight.dequantize().double().T


def random_weight(fmt: str, N: int, K: int, generator: torch.Generator) -> QuantizedWeight:
    """A weight quantized from random floats, or for a format gguf cannot quantize to (the K-quants), random blocks
    with small float16 super-block scales (as the test GGUFs hold them)."""
    if fmt not in FORMATS:
        rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))
        return QuantizedWeight(fmt, torch.from_numpy(random_blocks((N, K), KEPT[fmt], rng)))
    return QuantizedWeight(fmt, torch.from_numpy(quantize(torch.randn(N, K, generator=generator).numpy(), KEPT[fmt])))


@needs_kernels
@pytest.mark.parametrize("fmt", sorted(KEPT))
@pytest.mark.parametrize("N, K", [(40, 256), (576, 768), (17, 1536), (1, 256), (100, 512)])
def test_a_quantized_matmul_is_ggmls_math_and_each_row_is_its_own(fmt: str, N: int, K: int) -> None:
    generator = torch.Generator().manual_seed(N * K)
    weight = random_weight(fmt, N, K, generator)
    bias, x = torch.randn(N, generator=generator), torch.randn(13, K, generator=generator) * 3
    x[2] = 0  # a row of zeros quantizes with d = 0
    matmul = kernels.Matmul(weight.blocks, bias, fmt)
    y = matmul(x)
    reference = ggml_math(x, weight) + bias.double()
    assert y.dtype == torch.float32 and y.shape == (13, N)
    assert float((y.double() - reference).abs().max() / reference.abs().max()) < 1e-5
    for lo, hi in [(0, 1), (3, 4), (2, 9), (4, 13), (12, 13), (1, 9)]:
        assert torch.equal(kernels.Matmul(weight.blocks, bias, fmt)(x[lo:hi]), y[lo:hi]), (lo, hi)
    residual = torch.randn(13, N, generator=generator)
    assert torch.equal(matmul(x, residual), residual + y)


# Where each format's block holds its quants (ggml's layouts): the byte ranges that test_the_largest_quants_... fills
QUANT_BYTES = {
    "q8_0": [(2, 34)],
    "q4_0": [(2, 18)],
    "q4_1": [(4, 20)],
    "q5_0": [(2, 22)],
    "q5_1": [(4, 24)],
    "q4_k": [(16, 144)],
    "q5_k": [(16, 176)],
    "q6_k": [(0, 192)],
}


@needs_kernels
@pytest.mark.parametrize("fmt", sorted(KEPT))
def test_the_largest_quants_against_the_largest_inputs_sum_without_overflow(fmt: str) -> None:
    """Every quant at its most (all its bits set; Q8_0's at 127 and -128) against inputs that quantize to +-127 (all
    of one sign, then alternating): the kernel's integer sums (some kept in 16 bits before widening) at their
    largest still equal ggml's math."""
    generator = torch.Generator().manual_seed(7)
    weight = random_weight(fmt, 32, 512, generator)
    blocks = weight.blocks.clone().view(32, 512 // weight.block_inputs, weight.block_bytes)
    for start, end in QUANT_BYTES[fmt]:
        blocks[..., start:end] = 0xFF
    if fmt == "q8_0":
        blocks[1::2, :, 2:34] = 0x7F  # odd rows at +127, even ones at -128
    weight = QuantizedWeight(fmt, blocks.view(32, -1))
    x = torch.ones(3, 512)
    x[1] = -1
    x[2, 1::2] = -1
    y = kernels.Matmul(weight.blocks, None, fmt)(x)
    reference = ggml_math(x, weight)
    assert float((y.double() - reference).abs().max() / reference.abs().max()) < 1e-5


@needs_kernels
def test_linears_of_several_formats_run_as_one_output_each_run_on_its_own_kernel() -> None:
    generator = torch.Generator().manual_seed(3)
    weights = [
        random_weight(fmt, n, 256, generator) for fmt, n in (("q5_0", 32), ("q5_0", 16), ("q8_0", 20), ("q4_k", 17))
    ]
    bias, x = torch.randn(85, generator=generator), torch.randn(9, 256, generator=generator)
    runs = FormatRuns(weights, bias)
    assert runs.kernel == "linear_q5_0+linear_q8_0+linear_q4_k" and runs.out_features == 85
    y, residual = runs(x), torch.randn(9, 85, generator=generator)
    alone = [
        kernels.Matmul(torch.cat([w.blocks for w in ws]), b, fmt)(x)
        for fmt, ws, b in (
            ("q5_0", weights[:2], bias[:48]),
            ("q8_0", weights[2:3], bias[48:68]),
            ("q4_k", weights[3:], bias[68:]),
        )
    ]
    assert torch.equal(y, torch.cat(alone, -1))
    assert torch.equal(runs(x[3:5]), y[3:5]) and torch.equal(runs(x, residual), residual + y)
    assert torch.equal(runs(x.view(3, 3, 256), residual.view(3, 3, 85)), (residual + y).view(3, 3, 85))
    with pytest.raises(ValueError, match="a residual of"):
        runs(x, torch.randn(9, 86))
    with pytest.raises(ValueError, match="an output of"):
        kernels.Matmul(weights[2].blocks, None, "q8_0")(x, out=torch.empty(9, 21))


@needs_kernels
def test_pack_quantized_puts_each_blocks_scales_then_groups_of_four_inputs_by_column() -> None:
    weight = QuantizedWeight.of(torch.randn(20, 64, generator=torch.Generator().manual_seed(1)), "q4_1")
    raw = weight.blocks.view(20, 2, 20)  # (rows, blocks of 32, ggml's bytes: d, m, 16 bytes of nibbles)
    packed = kernels.pack_quantized("q4_1", weight.blocks)
    assert packed.shape == (2, 2, 64 + 256)  # 20 rows -> two blocks of 16 columns (the second zero-padded)
    assert torch.equal(packed[0, 1, :32].view(16, 2), raw[:16, 1, 0:2])  # column block 0, input block 1: scales
    assert torch.equal(packed[0, 1, 32:64].view(16, 2), raw[:16, 1, 2:4])  # mins
    groups = packed[0, 1, 64:].view(4, 16, 4)  # group g, column j: ggml's bytes 4g .. 4g + 3 of column j
    assert torch.equal(groups[2, 5], raw[5, 1, 4 + 8 : 4 + 12])
    assert not packed[1, :, :].view(2, -1)[:, 4 * 2 : 32].any()  # columns 20..31 padded with zero scales
    q8 = QuantizedWeight.of(torch.randn(16, 32), "q8_0")
    assert torch.equal(
        kernels.pack_quantized("q8_0", q8.blocks)[0, 0, 32:].view(8, 16, 4)[1, 3], q8.blocks[3, 2 + 4 : 2 + 8] ^ 0x80
    )  # int8 q stored as q + 128


# Where each format's block holds its float16 scales (d, and m or a K-quant's M)
SCALE_BYTES = {
    "q8_0": [0],
    "q4_0": [0],
    "q4_1": [0, 2],
    "q5_0": [0],
    "q5_1": [0, 2],
    "q4_k": [0, 2],
    "q5_k": [0, 2],
    "q6_k": [208],
}


@needs_kernels
@pytest.mark.parametrize("fmt", sorted(KEPT))
def test_pack_quantized_is_the_numpy_reference_bitwise(fmt: str) -> None:
    """Random blocks (any bytes are a block; the float16 scales made small and finite) packed as the numpy reference
    (tests/quant_pack_reference.py) packs them: 16 rows, 40 (padded to 48), rows at a stride, on 1 and 2 threads."""
    rng = np.random.default_rng(len(fmt) + sum(map(ord, fmt)))
    size = bytes_per_block(fmt)
    blocks = rng.integers(0, 256, (40, 3, 4, size), dtype=np.uint8)  # (rows, 3 weights side by side, blocks, bytes)
    for offset in SCALE_BYTES[fmt]:
        blocks[..., offset : offset + 2] = (
            (rng.uniform(-1, 1, blocks.shape[:3]) * 1e-3).astype(np.float16)[..., None].view(np.uint8)
        )
    wide, plain = torch.from_numpy(blocks.reshape(40, -1)), torch.from_numpy(blocks[:, 0].reshape(40, -1))
    cases = [
        plain[:16],
        plain,
        wide[:, 4 * size : 8 * size],
        wide[1::3, 8 * size :],
    ]  # the last 13 rows, at 3 rows' stride
    for threads in (1, 2):
        with torch_threads(threads):
            for weight in cases:
                packed, reference = kernels.pack_quantized(fmt, weight), quant_pack_reference.pack(fmt, weight)
                assert packed.shape == reference.shape and torch.equal(packed, reference), (threads, weight.shape)
            for cut in (16, 13):  # weights that make one matmul (q, k, v) packed as their rows stacked would be
                parts = [plain[:cut], wide[cut:, 4 * size : 8 * size]]
                assert torch.equal(kernels.pack_quantized(fmt, parts), kernels.pack_quantized(fmt, torch.cat(parts)))


def test_a_quantized_matmul_refuses_what_would_read_out_of_bounds() -> None:
    with pytest.raises(ValueError, match="uint8 blocks"):
        kernels.Matmul(torch.zeros(4, 35, dtype=torch.uint8), None, "q8_0")
    with pytest.raises(ValueError, match="uint8 blocks"):
        kernels.Matmul(torch.zeros(4, 34, dtype=torch.uint8), None, "q5_0")


@needs_kernels
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_model_quantized_at_load_is_its_quantized_weights_and_stays_close_to_float(tmp_path, fmt: str) -> None:
    folder = random_checkpoint(tmp_path, tiny_config())
    plain, quantized = load_model(folder, dtype="float32"), load_model(folder, quantize=fmt)
    layer = quantized.module.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and layer.self_attn.q_proj.quantized.format == fmt
    assert quantized.module.lm_head.quantized.format == "q8_0"  # the LM head finer, as llama.cpp keeps it
    assert packing(quantized.module).kernels and quantized.module.head.kernel.kernel == "linear_q8_0"
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    a, b = plain(tokens, plain.new_cache())[0], quantized(tokens, quantized.new_cache())[0]
    bound = {"q8_0": 0.05, "q4_0": 0.3, "q4_1": 0.3, "q5_0": 0.2, "q5_1": 0.2}[fmt]
    assert float((a - b).abs().max() / a.abs().max()) < bound
    blocks = sum(m.quantized.nbytes for m in quantized.module.modules() if isinstance(m, QuantizedLinear))
    assert weight_bytes(quantized) == blocks + sum(
        p.numel() * 4 for n, p in quantized.module.named_parameters() if "norm" in n
    )
    assert weight_bytes(quantized) < weight_bytes(plain) / 2


def test_quantizing_is_refused_where_it_cannot_run(tmp_path) -> None:
    folder = random_checkpoint(tmp_path, tiny_config())
    with pytest.raises(InvalidArgumentError, match="float32 activations"):
        load_model(folder, dtype="bfloat16", quantize="q8_0")
    with pytest.raises(InvalidArgumentError, match="unknown quantization 'q4_k'"):
        load_model(folder, quantize="q4_k")
    with pytest.raises(InvalidArgumentError, match="multiple of 32 inputs"):
        load_model(
            random_checkpoint(
                tmp_path / "narrow", tiny_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
            ),
            quantize="q8_0",
        )
    if not kernels.available(torch.float32):
        with pytest.raises(InvalidArgumentError, match="kernels, which do not run here"):
            load_model(folder, quantize="q8_0")
        return
    with torch_threads(2):  # the kernels run at any thread count
        assert packing(load_model(folder, quantize="q8_0").module).kernels


@needs_kernels
def test_a_quantized_forward_is_captured_and_replays_bitwise_as_op_by_op(tmp_path) -> None:
    from verispec.models.captured import CapturedForward

    model = load_model(random_checkpoint(tmp_path, tiny_config()), quantize="q4_1")
    tokens = torch.tensor([[3, 1, 4, 1, 5]])

    def decode(capture: bool, cache) -> torch.Tensor:
        model.execution.capture = capture
        model(tokens, cache)
        return torch.cat([model(torch.tensor([[t]]), cache)[0] for t in (9, 2, 6, 5)])

    cache = model.new_cache()  # alive while the program below replays into it (a capture holds it weakly)
    assert torch.equal(decode(True, cache), decode(False, model.new_cache()))
    steps = [c for c in model.execution.captured.values() if isinstance(c, CapturedForward) and c.rows == 1]
    assert steps[0].bound() is cache
    names = set(steps[0].program.timed(1))  # the kernels its program calls
    assert {"linear_q4_1", "linear_q8_0", "attend_f32_f16", "store_kv_f16"} <= names  # a float16 cache
