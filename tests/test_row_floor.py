"""Exact mode's row floor (models/row_floor.py): measured from the kernels, and what makes every row count exact."""

from __future__ import annotations

import pytest
import torch

from verispec import kernels
from verispec.bench.suite import read_suite
from verispec.models.default import default_paths
from verispec.tokenizer import load_tokenizer
from verispec.models.native import EXACT_ROWS, NativeModel, exact_width, load_model
from verispec.models.random_init import random_checkpoint, tiny_config
from verispec.models.row_floor import largest_differing_count, row_floor

SAMPLES = 48


def test_a_kernel_that_changes_path_below_four_rows_has_floor_four() -> None:
    """The check finds a kernel whose reduction order changes with the row count, and only where it does."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(SAMPLES, 256, generator=generator), torch.randn(256, 8, generator=generator)

    def changes_path(lo: int, hi: int) -> torch.Tensor:  # from 4 rows on, sums in float64 and rounds once
        return (x[lo:hi, :, None] * w).sum(1) if hi - lo < 4 else (x[lo:hi].double() @ w.double()).float()

    assert largest_differing_count(changes_path, SAMPLES, EXACT_ROWS) == 3
    assert largest_differing_count(lambda lo, hi: (x[lo:hi].double() @ w.double()).float(), SAMPLES,
                                    EXACT_ROWS) == 0


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, the count the row floor is measured at below."""


def shipped_on(own_kernels: bool) -> NativeModel:
    """The shipped target in exact bfloat16, on verispec's kernels or on PyTorch's."""
    if own_kernels and not kernels.available(torch.bfloat16):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    model = load_model(default_paths()[0], dtype="bfloat16", exact=True, fast=False)
    model.pack(EXACT_ROWS, own_kernels=own_kernels)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["own-kernels", "torch-kernels"])
def shipped_exact(request: pytest.FixtureRequest) -> NativeModel:
    return shipped_on(request.param)


@pytest.fixture(scope="module")
def shipped_torch() -> NativeModel:
    return shipped_on(False)


def in_chunks(model: NativeModel, tokens: torch.Tensor, sizes: list[int], start: int) -> torch.Tensor:
    """Logits (T, V) of tokens[start:] after tokens[:start], run as forwards of `sizes` tokens."""
    cache = model.new_cache()
    model(tokens[:, :start], cache)
    out, at = [], start
    for n in sizes:
        out.append(model(tokens[:, at: at + n], cache)[0])
        at += n
    return torch.cat(out)


# Every row count from 1 to 16 at many row offsets: 16 tokens as one forward, as m + (16 - m), and one at a time.
PARTITIONS = [[16]] + [[m, 16 - m] for m in range(1, 16)] + [[3, 5, 8], [7, 2, 7], [5, 5, 5, 1]]
START = 420  # after 420 tokens of real code: where differing sums show (a short or random context can hide them)


@pytest.fixture(scope="module")
def code() -> torch.Tensor:
    text = "".join(item["prompt"] for item in read_suite()[:3])
    return torch.tensor([load_tokenizer(default_paths()[0]).encode(text).ids[: START + 16]])


def test_the_shipped_target_gives_a_position_the_same_logits_at_every_row_count(shipped_exact: NativeModel,
                                                                                  code: torch.Tensor) -> None:
    alone = in_chunks(shipped_exact, code, [1] * 16, START)
    for sizes in PARTITIONS:
        assert torch.equal(in_chunks(shipped_exact, code, sizes, START), alone), sizes


def test_own_kernels_need_no_padding() -> None:
    """verispec's matmul and attention give a row the same bits at any count by construction, so the model takes
    floor 1 without measuring, and the measurement over the whole block agrees."""
    shipped_exact = shipped_on(True)
    width = exact_width(shipped_exact.context_length)
    assert shipped_exact.execution.row_floor(EXACT_ROWS, width) == 1 and not shipped_exact.execution.row_floors
    assert row_floor(shipped_exact.module, EXACT_ROWS, width) == 1


def test_below_its_floor_the_shipped_target_is_not_exact_here(shipped_torch: NativeModel, code: torch.Tensor) -> None:
    """So the test above can fail: on PyTorch's kernels, one row below the floor measured here, some position's
    logits differ."""
    shipped_exact = shipped_torch
    module, key = shipped_exact.execution, (1, EXACT_ROWS, exact_width(shipped_exact.context_length))
    alone = in_chunks(shipped_exact, code, [1] * 16, START)
    floor = module.row_floors[key]  # measured by the forwards above, at this one thread
    if floor == 1:
        pytest.skip("these kernels give a row the same bits at every count: no floor to go below")
    try:
        module.row_floors[key] = floor - 1
        assert any(not torch.equal(in_chunks(shipped_exact, code, sizes, START), alone) for sizes in PARTITIONS)
    finally:
        module.row_floors[key] = floor


@pytest.mark.parametrize("kind", ["own-kernels", "torch-packed", "plain"])
def test_an_mlp_width_off_the_vector_length_stays_exact(tmp_path, kind: str) -> None:
    """With the plain kernels, silu over a contiguous (rows x 100) tensor ends its vector loop on a row that depends
    on the count, so they pad every forward to 16 rows; packed, it runs row by row, and the measured floor holds."""
    if kind == "own-kernels" and not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    model = load_model(random_checkpoint(tmp_path, tiny_config(intermediate_size=100)), exact=True, fast=False)
    if kind != "plain":
        model.pack(EXACT_ROWS, own_kernels=kind == "own-kernels")
    tokens = torch.randint(0, 256, (1, 36), generator=torch.Generator().manual_seed(0))
    alone = in_chunks(model, tokens, [1] * 16, 20)
    for sizes in PARTITIONS:
        assert torch.equal(in_chunks(model, tokens, sizes, 20), alone), sizes
