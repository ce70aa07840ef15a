"""The batch KV cache: a slot per sequence, each with its own length; a batched forward equals each row alone."""

from __future__ import annotations

import pytest
import torch

from verispec.errors import ContextLengthError

PROMPTS = [[3, 9, 27, 81, 243], [1], [5, 6, 7, 8, 9, 10, 11, 12, 13]]


def alone(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), model.new_cache())[0]


def padded(rows: list[list[int]]) -> torch.Tensor:
    x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for b, row in enumerate(rows):
        x[b, : len(row)] = torch.tensor(row)
    return x


def test_a_batched_forward_is_each_row_alone(target) -> None:
    """Right-padded rows over scattered slots: each row's logits are its own forward's, and only its real tokens
    advance its slot."""
    cache = target.new_batch_cache(4, 64)
    slots = [0, 2, 3]  # not neighbours: the forward gathers them
    logits = target.forward_batch(padded(PROMPTS), cache, slots, [len(p) for p in PROMPTS])
    for b, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(logits[b, : len(prompt)], alone(target, prompt), rtol=1e-5, atol=1e-5)
    assert cache.lengths == [5, 0, 1, 9]
    more = [[4, 4], [8]]  # two slots go on, one of them by fewer tokens than the other
    logits = target.forward_batch(padded(more), cache, [0, 3], [2, 1])
    for b, (prompt, new) in enumerate(zip([PROMPTS[0], PROMPTS[2]], more)):
        torch.testing.assert_close(
            logits[b, : len(new)], alone(target, prompt + new)[len(prompt) :], rtol=1e-5, atol=1e-5
        )
    assert cache.lengths == [7, 0, 1, 10]


def test_rolling_one_slot_back_touches_no_other(target) -> None:
    cache = target.new_batch_cache(3, 64)
    target.forward_batch(padded(PROMPTS), cache, [0, 1, 2], [len(p) for p in PROMPTS])
    keys = cache.k.clone()
    assert cache.truncate(2, 4) == 5 and cache.lengths == [5, 1, 4]
    assert torch.equal(cache.k, keys)  # O(1): only the length moved
    # slot 2 goes on from its 4th token with another token; slot 0 goes on too: both as if alone
    logits = target.forward_batch(padded([[99], [42, 43]]), cache, [0, 2], [1, 2])
    torch.testing.assert_close(logits[0, :1], alone(target, PROMPTS[0] + [99])[-1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1, :2], alone(target, PROMPTS[2][:4] + [42, 43])[-2:], rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.k[:, 1], keys[:, 1]) and cache.lengths == [6, 1, 6]
    with pytest.raises(ValueError):
        cache.truncate(1, 2)  # past its length


def test_a_slot_cannot_overflow(target) -> None:
    cache = target.new_batch_cache(2, 8)
    target.forward_batch(padded([[1] * 6, [2]]), cache, [0, 1], [6, 1])
    with pytest.raises(ContextLengthError, match="slot 0"):
        target.forward_batch(padded([[1, 2, 3], [4, 5, 6]]), cache, [0, 1], [3, 3])
    assert cache.lengths == [6, 1]  # the refused forward wrote nothing
