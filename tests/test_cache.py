"""Tests for the preallocated KV cache and for the native model's incremental, rolled-back and masked forwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from verispec import reference
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.errors import ContextLengthError
from verispec.models.cache import SLOT_BLOCK, KVCache
from verispec.models.native import NativeModel, load_model

LAYERS, KV_HEADS, MAX_LEN, HEAD_DIM = 2, 2, 16, 8
ATOL = 1e-5


def make_cache() -> KVCache:
    return KVCache(LAYERS, 1, KV_HEADS, MAX_LEN, HEAD_DIM)


def fill(cache: KVCache, n: int, value: float) -> None:
    """Write `n` positions of constant keys/values into every layer and advance, as a forward does."""
    cache.reserve(n)
    kv = torch.full((1, KV_HEADS, n, HEAD_DIM), value)
    for layer in range(LAYERS):
        cache.update(layer, kv, kv)
    cache.advance(n)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config(max_position_embeddings=32), seed=3)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> NativeModel:
    return load_model(checkpoint, dtype="float32")


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor([tokens])


def fresh(model: NativeModel, tokens: list[int]) -> torch.Tensor:
    """Logits (T, V) of one forward of `tokens` into an empty cache."""
    return model(ids(*tokens), model.new_cache())[0]


SEQ = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


# --- KVCache on its own ------------------------------------------------------------------------------------------


def test_preallocated_shapes_dtype_and_empty_length() -> None:
    cache = KVCache(3, 2, 4, 10, 6, dtype=torch.float64)
    assert cache.k.shape == cache.v.shape == (3, 2, 4, SLOT_BLOCK, 6)  # slots in blocks; max_len is what fits
    assert cache.k.dtype == cache.v.dtype == torch.float64
    assert cache.max_len == 10 and cache.length == 0


def test_update_returns_everything_written_so_far_without_advancing() -> None:
    cache = make_cache()
    fill(cache, 3, 1.0)
    k, v = cache.update(0, torch.full((1, KV_HEADS, 2, HEAD_DIM), 2.0), torch.full((1, KV_HEADS, 2, HEAD_DIM), 3.0))
    assert k.shape == v.shape == (1, KV_HEADS, 5, HEAD_DIM)
    assert torch.all(k[:, :, :3] == 1) and torch.all(k[:, :, 3:] == 2) and torch.all(v[:, :, 3:] == 3)
    assert cache.length == 3


def test_reserve_raises_past_max_len() -> None:
    cache = make_cache()
    cache.reserve(MAX_LEN)
    fill(cache, MAX_LEN - 2, 1.0)
    cache.reserve(2)
    with pytest.raises(ContextLengthError, match=str(MAX_LEN)):
        cache.reserve(3)
    assert cache.length == MAX_LEN - 2


def test_truncate_is_o1_and_returns_removed_count() -> None:
    cache = make_cache()
    fill(cache, 10, 1.0)
    k, v, k_ptr, v_ptr = cache.k, cache.v, cache.k.data_ptr(), cache.v.data_ptr()
    before = cache.k.clone()
    assert cache.truncate(4) == 6
    assert cache.length == 4
    assert cache.truncate(4) == 0
    # Nothing reallocated, copied or cleared: only `length` moved.
    assert cache.k is k and cache.v is v
    assert cache.k.data_ptr() == k_ptr and cache.v.data_ptr() == v_ptr
    # bitwise: the slots never written are uninitialised memory, which may hold NaNs (never equal to themselves)
    assert torch.equal(cache.k.view(torch.uint8), before.view(torch.uint8))
    assert cache.truncate(0) == 4 and cache.length == 0


@pytest.mark.parametrize("bad", [-1, 6])
def test_truncate_rejects_out_of_range_lengths(bad: int) -> None:
    cache = make_cache()
    fill(cache, 5, 1.0)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(bad)
    assert cache.length == 5


# --- the native model with a cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[12], [1] * 12, [5, 7], [3, 1, 6, 2]], ids=["whole", "ones", "5+7", "3+1+6+2"])
def test_chunked_prefill_equals_one_forward(model: NativeModel, chunks: list[int]) -> None:
    full = fresh(model, SEQ)
    cache, start, parts = model.new_cache(), 0, []
    for n in chunks:
        parts.append(model(ids(*SEQ[start : start + n]), cache)[0])
        start += n
        assert cache.length == start
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=ATOL)


def test_rollback_then_refeed_equals_fresh_forward(model: NativeModel) -> None:
    cache = model.new_cache()
    model(ids(*SEQ), cache)
    assert cache.truncate(5) == len(SEQ) - 5
    # Fewer new tokens than were rolled back: stale positions 8..11 stay in storage and must never be read.
    new = [1, 2, 3]
    logits = model(ids(*new), cache)[0]
    assert cache.length == 8
    torch.testing.assert_close(logits, fresh(model, SEQ[:5] + new)[5:], rtol=0, atol=ATOL)
    # Roll back again, past what was just written, and continue differently.
    cache.truncate(2)
    logits = model(ids(200, 201), cache)[0]
    torch.testing.assert_close(logits, fresh(model, SEQ[:2] + [200, 201])[2:], rtol=0, atol=ATOL)


def test_write_past_max_len_raises_and_leaves_length(model: NativeModel) -> None:
    cache = model.new_cache(max_len=8)
    model(ids(*SEQ[:6]), cache)
    with pytest.raises(ContextLengthError):
        model(ids(*SEQ[6:9]), cache)
    assert cache.length == 6
    model(ids(*SEQ[6:8]), cache)  # what still fits is accepted
    assert cache.length == 8


def test_explicit_causal_mask_equals_no_mask(model: NativeModel) -> None:
    cache_a, cache_b = model.new_cache(), model.new_cache()
    model(ids(*SEQ[:4]), cache_a)
    model(ids(*SEQ[:4]), cache_b)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    masked = model(ids(*SEQ[4:]), cache_a, causal)
    torch.testing.assert_close(masked, model(ids(*SEQ[4:]), cache_b), rtol=0, atol=0)


# Token tree fed after a cached prefix: one shared node S, then branch X = (x1, x2) and branch Y = (y1, y2).
# New-token order [S, x1, x2, y1, y2]; each node sees the cache, its ancestors and itself.
TREE_MASK = torch.tensor(
    [
        [1, 0, 0, 0, 0],  # S
        [1, 1, 0, 0, 0],  # x1
        [1, 1, 1, 0, 0],  # x2
        [1, 0, 0, 1, 0],  # y1
        [1, 0, 0, 1, 1],  # y2
    ],
    dtype=torch.bool,
)
PREFIX, SHARED, X, Y = SEQ[:4], 50, [60, 61], [70, 71]


def tree_logits(model: NativeModel, tree: list[int], mask: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache()
    model(ids(*PREFIX), cache)
    logits = model(ids(*tree), cache, mask)[0]
    assert cache.length == len(PREFIX) + len(tree)
    return logits


def test_tree_mask_first_branch_equals_plain_forward_of_that_branch(model: NativeModel) -> None:
    """S, x1, x2 sit at the same positions as in a plain forward of PREFIX + S + X, so all three must match."""
    logits = tree_logits(model, [SHARED, *X, *Y], TREE_MASK)
    plain = fresh(model, PREFIX + [SHARED, *X])[len(PREFIX) :]
    torch.testing.assert_close(logits[:3], plain, rtol=0, atol=ATOL)


def test_tree_mask_branch_order_swapped_matches_other_branch(model: NativeModel) -> None:
    """With Y laid out first, S, y1, y2 are at plain positions and equal a plain forward of PREFIX + S + Y."""
    logits = tree_logits(model, [SHARED, *Y, *X], TREE_MASK)
    plain = fresh(model, PREFIX + [SHARED, *Y])[len(PREFIX) :]
    torch.testing.assert_close(logits[:3], plain, rtol=0, atol=ATOL)


def test_tree_mask_second_branch_ignores_its_sibling(model: NativeModel) -> None:
    """y1, y2 (positions shifted by len(X) in this runtime) do not depend on what the sibling branch holds."""
    a = tree_logits(model, [SHARED, *X, *Y], TREE_MASK)
    b = tree_logits(model, [SHARED, 90, 91, *Y], TREE_MASK)
    torch.testing.assert_close(a[3:], b[3:], rtol=0, atol=0)
    assert not torch.allclose(a[1:3], b[1:3])


def test_tree_mask_every_node_matches_reference_with_same_mask(model: NativeModel, checkpoint: Path) -> None:
    """The whole tree, second-branch nodes included, equals the float64 reference given the same positions and mask."""
    tree = [SHARED, *X, *Y]
    logits = tree_logits(model, tree, TREE_MASK)
    n, t = len(PREFIX), len(tree)
    full_mask = np.zeros((n + t, n + t), dtype=bool)  # prefix causal; tree nodes see the prefix and the tree mask
    full_mask[:n, :n] = reference.build_causal_mask(n)
    full_mask[n:, :n] = True
    full_mask[n:, n:] = TREE_MASK.numpy()
    expected = reference.full_lm_forward(PREFIX + tree, reference.load_params(checkpoint), full_mask)[0, n:]
    np.testing.assert_allclose(logits.numpy(), expected, rtol=0, atol=1e-4)


def test_token_tree_with_depth_positions_matches_each_branch(tmp_path) -> None:
    """Siblings at the same depth share a rotary position: each node's logits equal a plain forward of its path."""
    model = load_model(random_checkpoint(tmp_path, tiny_config(), seed=7))
    prefix, root, x, y = [10, 20, 30, 40], 50, [60, 61], [70, 71]
    # Tree after the prefix: root -> x0 -> x1 and root -> y0 -> y1, laid out as [root, x0, x1, y0, y1].
    parent = [-1, 0, 1, 0, 3]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    depth = []
    for node in range(5):
        ancestor, d = node, 0
        while ancestor >= 0:
            mask[node, ancestor] = True
            ancestor, d = parent[ancestor], d + (parent[ancestor] >= 0)
        depth.append(d)
    cache = model.new_cache()
    model(torch.tensor([prefix]), cache)
    tree = model(torch.tensor([[root, *x, *y]]), cache, mask, positions=torch.tensor(depth) + len(prefix))
    for branch, nodes in ((x, [0, 1, 2]), (y, [0, 3, 4])):
        plain = model(torch.tensor([prefix + [root] + branch]), model.new_cache())[:, len(prefix) :]
        torch.testing.assert_close(tree[:, nodes], plain, atol=1e-5, rtol=0)
