"""Rows of a table kept as ggml's blocks, dequantized as they are looked up (`kernels.gather_blocks`, rows.cpp): each
value bit for bit what gguf's numpy dequantization gives, an index out of range refused before anything is read,
and the call captured and replayed like any kernel's."""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from verispec import kernels

pytestmark = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)

# Where each format's block keeps its float16 scales (d, and m or dmin): ggml's layouts
SCALES = {
    "q8_0": [0],
    "q4_0": [0],
    "q4_1": [0, 2],
    "q5_0": [0],
    "q5_1": [0, 2],
    "q4_k": [0, 2],
    "q5_k": [0, 2],
    "q6_k": [208],
    "f16": [0],
    "bf16": [],
    "f32": [],
}


def random_table(format: str, N: int, D: int, rng: np.random.Generator, finite: bool = True) -> np.ndarray:
    """N rows of D inputs in `format` as uint8 (N, row bytes): random bytes, and with `finite`, the float16 scales
    (a float16 table's every value) random finite float16s: zeros, subnormals and up to 65504, of either sign."""
    inputs, size = GGML_QUANT_SIZES[kernels.TABLES[format]]
    blocks = rng.integers(0, 256, (N, D // inputs, size), dtype=np.uint8)
    if finite:
        for offset in SCALES[format]:
            bits = (
                rng.integers(0, 0x7C00, blocks.shape[:2], dtype=np.uint16)
                | rng.integers(0, 2, blocks.shape[:2], dtype=np.uint16) << 15
            )  # exponent below 31: finite
            blocks[..., offset : offset + 2] = bits[..., None].view(np.uint8)
    return blocks.reshape(N, -1)


def reference(blocks: np.ndarray, format: str) -> torch.Tensor:
    """The whole table dequantized by gguf (ggml's reference in numpy), float32 (N, D)."""
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, kernels.TABLES[format]), dtype=np.float32))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("format", list(kernels.TABLES))
def test_rows_are_ggmls_dequantized_values_bit_for_bit(format: str) -> None:
    rng = np.random.default_rng(len(format) * 7 + ord(format[-1]))
    N, D = 41, 3 * 256
    blocks = random_table(format, N, D, rng)
    index = torch.tensor([5, 0, N - 1, 5, 17, 17, 17, 2, N - 1, 0])  # repeats, both ends
    y = kernels.gather_blocks(torch.from_numpy(blocks), format, index)
    assert y.dtype == torch.float32 and y.shape == (len(index), D)
    assert torch.equal(bits(y), bits(reference(blocks, format)[index]))
    assert kernels.gather_blocks(torch.from_numpy(blocks), format, torch.tensor([], dtype=torch.int64)).shape == (0, D)


@pytest.mark.parametrize("format", list(kernels.TABLES))
def test_any_bytes_dequantize_as_ggmls_nans_included(format: str) -> None:
    """Random bytes everywhere: infinite, NaN and subnormal scales as well. Every value that is not a NaN has gguf's
    bits, and the NaNs fall where gguf's do (their payloads are the compiler's and numpy's business)."""
    rng = np.random.default_rng(3 + len(format))
    N, D = 64, 512
    blocks = random_table(format, N, D, rng, finite=False)
    y, expected = kernels.gather_blocks(torch.from_numpy(blocks), format, torch.arange(N)), reference(blocks, format)
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan) and torch.equal(bits(y)[~nan], bits(expected)[~nan])
    if format in ("f32", "f16", "bf16"):  # conversions of bits, NaN payloads (signaling ones too) kept
        assert torch.equal(bits(y), bits(expected))


def test_a_read_only_memory_map_and_rows_apart(tmp_path: Path) -> None:
    """The table as a GGUF's loader holds it, a read-only memory map of the file (read, never written), and as a
    view whose rows are further apart than their bytes (the first columns of a wider table)."""
    rng = np.random.default_rng(11)
    blocks = random_table("q6_k", 30, 512, rng)
    blocks.tofile(tmp_path / "table.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        mapped = torch.from_numpy(np.memmap(tmp_path / "table.bin", dtype=np.uint8, mode="r", shape=blocks.shape))
    index = torch.tensor([29, 3, 3, 0])
    assert torch.equal(bits(kernels.gather_blocks(mapped, "q6_k", index)), bits(reference(blocks, "q6_k")[index]))
    half = torch.from_numpy(blocks)[:, :210]  # each row's first block: 256 inputs
    assert half.stride(0) == 420
    assert torch.equal(
        bits(kernels.gather_blocks(half, "q6_k", index)),
        bits(reference(np.ascontiguousarray(blocks[:, :210]), "q6_k")[index]),
    )


def test_an_index_out_of_range_is_refused_before_anything_is_read() -> None:
    blocks = torch.from_numpy(random_table("q4_k", 10, 256, np.random.default_rng(5)))
    for bad in ([3, 10], [-1], [0, 1, 2, 11]):
        with pytest.raises(IndexError, match="outside the 10 rows"):
            kernels.gather_blocks(blocks, "q4_k", torch.tensor(bad))
    y = torch.full((2, 256), 7.0)  # as a replay would write it: nothing written when one index is out
    call = kernels.program(
        [("gather_blocks", [blocks, 10, 144, torch.tensor([1, 10]), 2, 256, y, 256, int(kernels.TABLES["q4_k"])])]
    )
    with pytest.raises(IndexError, match="refused its inputs"):
        call()
    assert torch.equal(y, torch.full((2, 256), 7.0))


def test_bad_tables_and_indices_are_refused() -> None:
    blocks = torch.from_numpy(random_table("q8_0", 4, 64, np.random.default_rng(6)))  # (4, 68)
    index = torch.tensor([1])
    for table, format, at, match in [
        (blocks, "q3_k", index, "not 'q3_k'"),
        (blocks, "q4_0", index, "blocks of 18 bytes"),  # 68 bytes a row: not whole Q4_0 blocks
        (blocks.view(torch.int8), "q8_0", index, "uint8"),
        (blocks[:, None], "q8_0", index, "uint8"),
        (blocks.t(), "q8_0", index, "uint8"),
        (blocks, "q8_0", index.int(), "int64"),
        (blocks, "q8_0", index[None], "int64"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernels.gather_blocks(table, format, at)


def test_a_captured_lookup_replays_on_new_indices() -> None:
    rng = np.random.default_rng(8)
    blocks = random_table("q5_k", 12, 256, rng)
    table, expected = torch.from_numpy(blocks), reference(blocks, "q5_k")
    index = torch.tensor([4, 4, 9])
    with kernels.capturing() as capture:
        y = kernels.gather_blocks(table, "q5_k", index)
    program = capture.program()
    index.copy_(torch.tensor([11, 0, 6]))  # a replay reads the index tensor the capture saw
    program()
    assert torch.equal(bits(y), bits(expected[[11, 0, 6]]))
    index[1] = 12
    with pytest.raises(IndexError, match="refused its inputs"):
        program()
