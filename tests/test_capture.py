"""Captured forwards (kernels/capture.py, models/captured.py): a forward on verispec's kernels recorded once per
shape and replayed by one C call gives the same bits as the same kernels called one by one, whatever ran in between;
a forward that computes outside the kernels is refused for capture and runs op by op."""

from __future__ import annotations

import ctypes
from pathlib import Path
from unittest import mock

import pytest
import torch

from drafting import in_threads
from verispec import kernels
from verispec.errors import InvalidArgumentError
from verispec.heads.eagle import EagleHead, head_config, pack_head
from verispec.kernels.capture import Program
from verispec.models import captured
from verispec.models.cache import KVCache
from verispec.models.captured import CapturedForward
from verispec.models.llama import RMSNorm
from verispec.models.native import EXACT_ROWS, NativeModel, load_model
from verispec.models.packed import swapped
from verispec.train.loop import init_weights

needs_kernels = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)
pytestmark = needs_kernels
PROMPT = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(3))


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine (tests/test_pool.py takes every count)."""


def on_kernels(folder: Path, dtype: torch.dtype, exact: bool, capture: bool) -> NativeModel:
    model = load_model(folder, dtype=dtype, exact=exact, fast=False)
    model.pack(EXACT_ROWS if exact else 1, own_kernels=True)
    model.execution.capture = capture
    return model


def session(model: NativeModel) -> list[torch.Tensor]:
    """Every output of a decoding-like session, twice over on two caches in turn: prefill, single tokens, hidden
    states, a rollback, a tree with depths as positions, its accepted path compacted, a layer-skip forward."""
    caches, out = (model.new_cache(), model.new_cache()), []
    for step in range(2):
        for cache in caches:
            if step == 0:
                out.append(model(PROMPT[:, : 17 + len(out)], cache))
            for token in (5, 9):
                out.append(model(torch.tensor([[token + step]]), cache))
            out += list(model(torch.tensor([[1, 2, 3, 4]]), cache, hidden=[0, -1]))
            cache.truncate(cache.length - 2)
            mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
            start = cache.length
            out.append(model(torch.tensor([[7, 8, 9, 10]]), cache, mask, positions=start + torch.tensor([0, 1, 1, 2])))
            cache.keep(start, [0, 2, 3])
            out.append(model(torch.tensor([[11]]), cache, layers=[0]))
            cache.truncate(cache.length - 1)
    return out


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "ordinary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_replays_give_the_bits_of_the_kernels_called_one_by_one(
    pair_dirs: tuple[Path, Path], dtype: torch.dtype, exact: bool
) -> None:
    captured, op_by_op = (on_kernels(pair_dirs[0], dtype, exact, capture) for capture in (True, False))
    with mock.patch.object(Program, "__call__", autospec=True, side_effect=Program.__call__) as replays:
        replayed = session(captured)
    # 22 forwards in either mode (exact mode's prefills are one chunk on the kernels) of 6 shapes (T and the states
    # asked for): the two prefills (17 and 24 rows, past EAGER_ROWS) seen once, op by op; 4 shapes of a few rows
    # captured the first time and replayed from then on.
    assert replays.call_count == 22 - 2 - 4
    for a, b in zip(replayed, session(op_by_op), strict=True):
        assert torch.equal(a, b)


def test_the_eagle_heads_replays_give_the_bits_of_its_kernels_called_one_by_one(pair_dirs: tuple[Path, Path]) -> None:
    """The head's forwards (its fc as two matmuls, its layer) captured and replayed, a chain and a tree, on two caches
    in turn, against the same head op by op."""
    target = load_model(pair_dirs[0], dtype=torch.bfloat16)
    heads = []
    for capture in (True, False):
        torch.manual_seed(0)
        head = EagleHead(head_config(target.config))
        init_weights(head)
        head = pack_head(head.to(torch.bfloat16).eval().requires_grad_(False), 1)
        head.capture = capture
        heads.append(head)
    assert heads[0].halves is not None
    D = target.config.hidden_size
    inputs = [torch.randn(1, 6, D, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(2)]
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    outs = []
    for head in heads:
        caches, out = [head.new_cache(64, torch.bfloat16), head.new_cache(64, torch.bfloat16)], []
        with mock.patch.object(Program, "__call__", autospec=True, side_effect=Program.__call__) as replays:
            with torch.inference_mode():
                for step in range(3):
                    for cache in caches:
                        if step == 0:
                            out.append(head(inputs[0][:, :4], inputs[1][:, :4], cache))
                        out.append(head(inputs[0][:, 4:5], inputs[1][:, 4:5], cache))
                        start = cache.length
                        out.append(
                            head(
                                inputs[0][:, 3:6],
                                inputs[1][:, 3:6],
                                cache,
                                start + torch.tensor([0, 1, 1]),
                                torch.cat((torch.ones(3, start, dtype=torch.bool), mask), 1),
                            )
                        )
                        cache.truncate(start)
        outs.append((out, replays.call_count))
    assert outs[0][1] == 11 and outs[1][1] == 0  # 14 forwards of 3 shapes (4, 1 and 3 rows)
    for a, b in zip(outs[0][0], outs[1][0], strict=True):
        assert torch.equal(a, b)


def test_a_capture_is_the_models_keyed_by_shape_and_serves_every_cache(pair_dirs: tuple[Path, Path]) -> None:
    model = on_kernels(pair_dirs[0], torch.bfloat16, exact=True, capture=True)
    for _ in range(2):  # a second generation's cache reuses the captures
        cache = model.new_cache()
        model(PROMPT[:, :4], cache)
        for token in (1, 2, 3):
            model(torch.tensor([[token]]), cache)
        model(PROMPT[:, :4], cache, hidden=[-1])
    captured = model.execution.captured
    assert sorted((key[0], key[3]) for key in captured) == [(1, ()), (4, ()), (4, (-1,))]
    assert all(isinstance(capture, CapturedForward) for capture in captured.values())
    long = torch.randint(0, 256, (1, 70))  # past MAX_ROWS (ordinary mode: one forward): not captured
    ordinary = on_kernels(pair_dirs[0], torch.bfloat16, exact=False, capture=True)
    ordinary(long, ordinary.new_cache())
    assert not ordinary.execution.captured


def test_caches_of_nearby_sizes_share_captures_and_the_least_recently_used_go_past_the_bound(
    pair_dirs: tuple[Path, Path], monkeypatch
) -> None:
    model = on_kernels(pair_dirs[0], torch.float32, exact=False, capture=True)
    for max_len in (40, 60, 100):  # one block of slots: one layout
        cache = model.new_cache(max_len)
        model(PROMPT[:, :3], cache)
        model(PROMPT[:, 3:4], cache)
    assert sorted(key[0] for key in model.execution.captured) == [1, 3]
    model(PROMPT[:, :3], model.new_cache(100))  # the 3-row capture, the first made, is now the most recently used
    monkeypatch.setattr(captured, "MAX_HELD_ROWS", 7)
    model(PROMPT[:, :4], model.new_cache(100))  # 3 + 1 + 4 rows would be 8: the least recently used (1 row) goes
    assert {key[0]: type(capture) for key, capture in model.execution.captured.items()} == {
        3: CapturedForward,
        4: CapturedForward,
    }


def test_a_forward_past_eager_rows_is_captured_when_its_shape_comes_again(pair_dirs: tuple[Path, Path]) -> None:
    model = on_kernels(pair_dirs[0], torch.float32, exact=False, capture=True)
    prompt = torch.randint(0, 256, (1, captured.EAGER_ROWS + 1))
    model(prompt, model.new_cache())  # a prompt's prefill, seen once: op by op
    assert list(model.execution.captured.values()) == [captured.ONCE]
    model(prompt, model.new_cache())
    assert [type(capture) for capture in model.execution.captured.values()] == [CapturedForward]


def test_a_prefill_past_eager_rows_is_never_captured(pair_dirs: tuple[Path, Path]) -> None:
    """A prompt's forward (its last row's logits only) past EAGER_ROWS runs op by op however often its shape comes,
    so that a prompt asked again does not take the decoding shapes' room."""
    model = on_kernels(pair_dirs[0], torch.float32, exact=False, capture=True)
    prompt = torch.randint(0, 256, (1, captured.EAGER_ROWS + 1))
    logits = [model(prompt, model.new_cache(), logits_to_keep=1) for _ in range(3)]
    assert not model.execution.captured
    assert torch.equal(logits[0], logits[2]) and logits[0].shape[1] == 1


def test_a_short_prefill_is_captured_when_its_shape_comes_again(pair_dirs: tuple[Path, Path]) -> None:
    """A prompt's forward of at most EAGER_ROWS rows runs op by op the first time (a prompt's length seldom comes
    again: capturing it would slow the first token), and is captured the second; the bits are the same each time."""
    model = on_kernels(pair_dirs[0], torch.float32, exact=False, capture=True)
    prompt = torch.randint(0, 256, (1, captured.EAGER_ROWS))
    logits = [model(prompt, model.new_cache(), logits_to_keep=1)]
    assert list(model.execution.captured.values()) == [captured.ONCE]
    logits += [model(prompt, model.new_cache(), logits_to_keep=1) for _ in range(2)]
    assert [type(capture) for capture in model.execution.captured.values()] == [CapturedForward]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_a_replay_checks_its_inputs_shapes(pair_dirs: tuple[Path, Path]) -> None:
    model = on_kernels(pair_dirs[0], torch.float32, exact=False, capture=True)
    cache = model.new_cache()
    model(PROMPT[:, :4], cache)
    model(PROMPT[:, 4:8], cache)  # the 4-row shape is replayed now
    with pytest.raises(ValueError, match=r"inputs of \[\(1, 4\), \(1,\)\]"):
        model(PROMPT[:, 8:12], cache, positions=torch.tensor([8]))


def test_a_forward_that_computes_outside_the_kernels_runs_op_by_op(pair_dirs: tuple[Path, Path]) -> None:
    """The final norm on PyTorch's ops: capturing it is refused, and the forward gives what op by op gives."""
    models = [on_kernels(pair_dirs[0], torch.float32, exact=True, capture=capture) for capture in (True, False)]
    for model in models:
        model.module.model.norm = swapped(model.module.model.norm, RMSNorm)
    out = [session(model) for model in models]
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)
    # refused, and not tried again; the prefills, seen once, were never tried
    assert set(models[0].execution.captured.values()) == {captured.REFUSED, captured.ONCE}


def chain_by_forwards(model: NativeModel, tokens: torch.Tensor, cache, n: int) -> list[int]:
    """What `greedy_chain` does, a forward and an argmax at a time."""
    out = [int(model(tokens, cache)[0, -1].argmax())]
    while len(out) < n:
        out.append(int(model(torch.tensor([out[-1:]]), cache)[0, -1].argmax()))
    return out


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "ordinary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_greedy_chain_is_one_replay_with_the_bits_of_forwards_one_by_one(
    pair_dirs: tuple[Path, Path], dtype: torch.dtype, exact: bool
) -> None:
    """After two tokens (the draft's last proposal and the target's bonus) and after one (a correction), as a draft
    model proposes; and after a prompt, which runs as an ordinary forward first."""
    model = on_kernels(pair_dirs[1], dtype, exact, capture=True)

    def session(chain) -> tuple[list[list[int]], KVCache]:
        cache, outs = model.new_cache(), []
        for tokens in (PROMPT[:, :6], PROMPT[:, 6:8]):
            outs.append(chain(tokens, cache, 4))
            outs.append(chain(torch.tensor([outs[-1][-1:]]), cache, 3))
        return outs, cache

    expected, reference = session(lambda tokens, cache, n: chain_by_forwards(model, tokens, cache, n))
    with mock.patch.object(Program, "__call__", autospec=True, side_effect=Program.__call__) as replays:
        for _ in range(3):
            outs, cache = session(model.greedy_chain)
            L = cache.length
            assert outs == expected and L == reference.length == (6 + 3) + (1 + 2) + (2 + 3) + (1 + 2)
            assert torch.equal(cache.k[:, :, :, :L], reference.k[:, :, :, :L])
            assert torch.equal(cache.v[:, :, :, :L], reference.v[:, :, :, :L])
    # A chain whose two shapes are captured is one program; one whose first shape is not runs a forward at a time.
    # The prompt's 5-token forward and a chain's 2-token first forward keep their last row's logits only, as a
    # prefill: op by op the first time their shape comes, captured the second. First session: the 5-token forward
    # op by op, the three chains from 1 token (a program each), the one from 2 a forward at a time (its first op by
    # op, 3 one-token replays): 6. Second: the same, those two shapes captured now: 6. Third: 5 (the 5-token forward
    # replayed, 4 chain programs).
    assert replays.call_count == 6 + 6 + 5
    assert all(isinstance(key[0], int) for key in model.execution.captured)  # no capture of a chain of its own


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "ordinary"])
def test_a_greedy_chain_among_a_draft_vocabulary(pair_dirs: tuple[Path, Path], exact: bool) -> None:
    """An LM head over some tokens gives their logits with the whole head's bits (the same dot products), and a
    chain among them picks, a forward at a time and then as one program, the argmax of those logits."""
    model = on_kernels(pair_dirs[1], torch.bfloat16, exact, capture=True)
    ids = torch.randperm(model.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    head = model.vocab_head(ids)
    with torch.inference_mode():
        whole, part = model.new_cache(), model.new_cache()
        assert torch.equal(model(PROMPT[:, :6], part, head=head), model(PROMPT[:, :6], whole)[..., ids])

    def by_forwards(tokens: torch.Tensor, cache: KVCache, n: int) -> list[int]:
        out = []
        while len(out) < n:
            out.append(int(ids[model(tokens, cache)[0, -1, ids].argmax()]))
            tokens = torch.tensor([out[-1:]])
        return out

    def session(chain) -> list[list[int]]:
        cache, outs = model.new_cache(), []
        for tokens in (PROMPT[:, :6], PROMPT[:, 6:8]):
            outs.append(chain(tokens, cache, 4))
            outs.append(chain(torch.tensor([outs[-1][-1:]]), cache, 3))
        return outs

    expected = session(by_forwards)
    assert all(token in ids for chain in expected for token in chain)

    def among(tokens: torch.Tensor, cache: KVCache, n: int) -> list[int]:
        return model.greedy_chain(tokens, cache, n, head)

    for _ in range(2):  # capturing the head's shapes as it goes (a prefill's, and a chain's first, the second time)
        assert session(among) == expected
    with mock.patch.object(Program, "__call__", autospec=True, side_effect=Program.__call__) as replays:
        for _ in range(2):
            assert session(among) == expected
    assert replays.call_count == 2 * 5  # a session: the prompt's forward, then each chain as one program
    with pytest.raises(InvalidArgumentError, match="token ids, each below"):
        model.vocab_head(torch.tensor([0, model.vocab_size]))


def test_threads_sharing_a_model_replay_and_evict_captures_safely(pair_dirs: tuple[Path, Path], monkeypatch) -> None:
    """Three threads decode greedy chains of many shapes on one model, with captures evicted all the while."""
    import random

    model = on_kernels(pair_dirs[1], torch.float32, exact=False, capture=True)
    reference = on_kernels(pair_dirs[1], torch.float32, exact=False, capture=False)
    monkeypatch.setattr(captured, "MAX_HELD_ROWS", 8)
    cases = [
        (torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(i)), n)
        for i, (T, n) in enumerate((T, n) for T in (1, 2, 5) for n in (1, 3, 6))
    ]
    expected = [chain_by_forwards(reference, tokens, reference.new_cache(64), n) for tokens, n in cases]
    failures: list[str] = []

    def work(seed: int) -> None:
        order = list(range(len(cases))) * 4
        random.Random(seed).shuffle(order)
        try:
            for i in order:
                tokens, n = cases[i]
                if model.greedy_chain(tokens, model.new_cache(64), n) != expected[i]:
                    failures.append(f"case {i}")
        except Exception as error:  # noqa: BLE001 (reported below, with the thread's other failures)
            failures.append(repr(error))

    in_threads(work, list(range(3)))
    assert not failures


def test_a_greedy_chain_that_fails_leaves_the_cache_as_it_was(pair_dirs: tuple[Path, Path], monkeypatch) -> None:
    from verispec.models import execution

    model = on_kernels(pair_dirs[1], torch.float32, exact=False, capture=True)
    cache = model.new_cache()
    model(PROMPT[:, :5], cache)
    forward, calls = execution.Execution.forward, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # a prompt's forward, then the chain's first two, forward by forward
            raise RuntimeError("interrupted")
        return forward(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(execution.Execution, "forward", failing)
        with pytest.raises(RuntimeError, match="interrupted"):
            model.greedy_chain(PROMPT[:, 5:9], cache, 4)
    assert cache.length == 5
    model.greedy_chain(PROMPT[:, 5:6], cache, 4)  # both shapes of a chain from one token are captured now
    cache.truncate(5)

    def broken(first, step, cache, *args):
        cache.length += 2  # part of the way
        raise RuntimeError("interrupted")

    monkeypatch.setattr(execution, "replay_chain", broken)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.greedy_chain(PROMPT[:, 5:6], cache, 4)
    assert cache.length == 5


def test_a_greedy_chain_that_cannot_be_captured_runs_op_by_op_from_the_start(pair_dirs: tuple[Path, Path]) -> None:
    model = on_kernels(pair_dirs[1], torch.float32, exact=False, capture=True)
    model.module.model.norm = swapped(model.module.model.norm, RMSNorm)  # on PyTorch's ops: refused part of the way
    expected = [chain_by_forwards(model, PROMPT[:, :6], model.new_cache(), 5) for _ in range(3)]
    for tokens in expected:
        cache = model.new_cache()
        assert model.greedy_chain(PROMPT[:, :6], cache, 5) == tokens and cache.length == 6 + 4
    assert captured.REFUSED in model.execution.captured.values()


@pytest.mark.parametrize("inference", [True, False], ids=["inference-mode", "grad-mode"])
def test_capturing_refuses_pytorch_ops_that_compute_and_lets_views_through(inference: bool) -> None:
    with torch.inference_mode(inference):
        x = torch.ones(4, 6)
        with kernels.capturing() as capture:
            y = x.view(6, 4)[1:].transpose(0, 1).reshape(4, 5)
            z = torch.empty(3)
            with pytest.raises(kernels.NotCapturable, match="add"):
                x + 1
            for copying in (lambda: x.t().reshape(24), lambda: x.t().contiguous(), lambda: x.to(torch.bfloat16)):
                with pytest.raises(kernels.NotCapturable):  # declared as views, but they copy here
                    copying()
    assert y.shape == (4, 5) and z.shape == (3,) and capture.calls == []


def test_a_replay_reads_new_inputs_and_the_length_when_it_runs() -> None:
    """Kernel calls recorded on buffers replay on whatever the buffers hold then, the cache's slot included."""
    table = torch.arange(12, dtype=torch.float32).view(6, 2)
    index = torch.tensor([1, 4])
    keys, values = torch.zeros(1, 5, 2), torch.zeros(1, 5, 2)
    start = ctypes.c_int64(0)
    with kernels.capturing() as capture:
        rows = kernels.gather(table, index)  # (2, 2)
        kernels.store_kv(rows, rows, keys, values, start)
    program = capture.program()
    assert torch.equal(keys[0, :2], table[[1, 4]])
    index.copy_(torch.tensor([5, 0]))  # a replay reads the index tensor the capture saw
    start.value = 3
    program()
    assert torch.equal(rows, table[[5, 0]]) and torch.equal(values[0, 3:], table[[5, 0]])
    index[0] = 6  # out of the table: the gather refuses, nothing is read
    with pytest.raises(IndexError, match="refused its inputs"):
        program()


def test_a_replay_into_another_cache_leaves_no_pointer_into_the_first(pair_dirs: tuple[Path, Path]) -> None:
    """A program's raw pointers into a cache (`KVCache.storage`: keys, values, the length cell) are rewritten for
    the cache a replay names: after a replay into a second cache, no word of the program points into the first."""
    model = on_kernels(pair_dirs[1], torch.float32, exact=False, capture=True)
    first, second = model.new_cache(), model.new_cache()

    def pointers_into(cache: KVCache, capture: CapturedForward) -> int:
        spans = []
        for place in cache.storage().values():
            size = place.untyped_storage().nbytes() if isinstance(place, torch.Tensor) else ctypes.sizeof(place)
            spans.append((kernels.address(place), kernels.address(place) + size))
        return sum(any(lo <= word < hi for lo, hi in spans) for word in capture.program.code.tolist())

    model(PROMPT[:, :3], first)  # captured into the first cache
    capture = next(c for c in model.execution.captured.values() if isinstance(c, CapturedForward))
    assert pointers_into(first, capture) > 0 and pointers_into(second, capture) == 0
    model(PROMPT[:, :3], second)  # replayed into the second
    assert pointers_into(first, capture) == 0 and pointers_into(second, capture) > 0
    assert torch.equal(second.k[:, :, :, :3], first.k[:, :, :, :3]) and first.length == second.length == 3
