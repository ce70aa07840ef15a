"""Exact mode at every row count: a position's logits the same however its tokens are split into forwards, on
verispec's kernels (no padding: batch-invariant by construction) and on PyTorch's (every chunk padded to its full
row count, `Execution.row_floor`)."""

from __future__ import annotations

import pytest
import torch

from verispec import kernels
from verispec.bench.suite import read_suite
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.checkpoints.shipped import default_paths
from verispec.checkpoints.tokenizer import load_tokenizer
from verispec.models import execution
from verispec.models.cache import KVCache
from verispec.models.native import EXACT_ROWS, NativeModel, load_model


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine."""


def shipped_on(own_kernels: bool, dtype: str = "bfloat16") -> NativeModel:
    """The shipped target in exact mode (bfloat16 by default), on verispec's kernels or on PyTorch's."""
    if own_kernels and not kernels.available(torch.bfloat16):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    model = load_model(default_paths()[0], dtype=dtype, exact=True, fast=False)
    model.pack(EXACT_ROWS, own_kernels=own_kernels)
    return model


@pytest.fixture(
    scope="module",
    params=[(True, "bfloat16"), (False, "bfloat16"), (False, "float32")],
    ids=["own-kernels", "torch-kernels", "torch-kernels-float32"],
)
def shipped_exact(request: pytest.FixtureRequest) -> NativeModel:
    return shipped_on(*request.param)


@pytest.fixture(scope="module")
def shipped_torch() -> list[NativeModel]:
    """In bfloat16 and in float32: which of oneDNN's matmuls depend on the row count depends on the CPU (on Zen 4
    the bfloat16 ones did; on Sapphire Rapids, whose bfloat16 matmuls run on AMX, only the float32 ones)."""
    return [shipped_on(False, "bfloat16"), shipped_on(False, "float32")]


def prefilled(model: NativeModel, tokens: torch.Tensor, start: int) -> KVCache:
    """A cache holding tokens[:start], prefilled once for every partition."""
    cache = model.new_cache()
    model(tokens[:, :start], cache)
    return cache


def in_chunks(model: NativeModel, cache: KVCache, tokens: torch.Tensor, sizes: list[int], start: int) -> torch.Tensor:
    """Logits (T, V) of tokens[start:] after the cache's first `start` (rolled back to them: the keys and values a
    fresh prefill writes), run as forwards of `sizes` tokens."""
    cache.truncate(start)
    out, at = [], start
    for n in sizes:
        out.append(model(tokens[:, at : at + n], cache)[0])
        at += n
    return torch.cat(out)


# Every row count from 1 to 16 at many row offsets: 16 tokens as one forward, as m + (16 - m), and one at a time.
PARTITIONS = [[16]] + [[m, 16 - m] for m in range(1, 16)] + [[3, 5, 8], [7, 2, 7], [5, 5, 5, 1]]
START = 420  # after 420 tokens of real code: where differing sums show (a short or random context can hide them)


@pytest.fixture(scope="module")
def code() -> torch.Tensor:
    text = "".join(item["prompt"] for item in read_suite()[:3])
    return torch.tensor([load_tokenizer(default_paths()[0]).encode(text).ids[: START + 16]])


def test_the_shipped_target_gives_a_position_the_same_logits_at_every_row_count(
    shipped_exact: NativeModel, code: torch.Tensor
) -> None:
    cache = prefilled(shipped_exact, code, START)
    alone = in_chunks(shipped_exact, cache, code, [1] * 16, START)
    for sizes in PARTITIONS:
        assert torch.equal(in_chunks(shipped_exact, cache, code, sizes, START), alone), sizes


def test_own_kernels_need_no_padding_and_pytorchs_pad_every_chunk() -> None:
    assert shipped_on(True).execution.row_floor(EXACT_ROWS) == 1
    assert shipped_on(False).execution.row_floor(EXACT_ROWS) == EXACT_ROWS


def test_unpadded_the_shipped_target_is_not_exact_on_pytorchs_kernels(
    shipped_torch: list[NativeModel], code: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So the test above can fail: on PyTorch's kernels, forwards of fewer rows than a chunk's, unpadded, give some
    position other logits (in bfloat16 or in float32, by CPU)."""
    monkeypatch.setattr(execution.Execution, "row_floor", lambda self, rows: 1)
    caches = [prefilled(model, code, START) for model in shipped_torch]
    alone = [in_chunks(model, cache, code, [1] * 16, START) for model, cache in zip(shipped_torch, caches)]
    assert any(
        not torch.equal(in_chunks(model, cache, code, sizes, START), one)
        for model, cache, one in zip(shipped_torch, caches, alone)
        for sizes in PARTITIONS
    )


@pytest.mark.parametrize("kind", ["own-kernels", "torch-packed", "plain"])
def test_an_mlp_width_off_the_vector_length_stays_exact(tmp_path, kind: str) -> None:
    """silu over a contiguous (rows x 100) tensor ends its vector loop on a row that depends on the count: padded to
    the chunk's 16 rows (or on verispec's kernels, row by row) every row count stays exact."""
    if kind == "own-kernels" and not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    model = load_model(random_checkpoint(tmp_path, tiny_config(intermediate_size=100)), exact=True, fast=False)
    if kind != "plain":
        model.pack(EXACT_ROWS, own_kernels=kind == "own-kernels")
    tokens = torch.randint(0, 256, (1, 36), generator=torch.Generator().manual_seed(0))
    cache = prefilled(model, tokens, 20)
    alone = in_chunks(model, cache, tokens, [1] * 16, 20)
    for sizes in PARTITIONS:
        assert torch.equal(in_chunks(model, cache, tokens, sizes, 20), alone), sizes
