"""Exact mode: a position's logits are bitwise the same however many tokens share the forward, so greedy speculative
decoding is bit-identical to plain greedy decoding, in bfloat16 as in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verispec import kernels
from verispec.bench.harness import torch_threads
from verispec.checkpoints.blocks import FORMATS
from verispec.drafters import DraftModel, LayerSkip, Lookahead, PromptLookup, SuffixDecoding
from verispec.errors import ContextLengthError
from verispec.generate import generate
from verispec.models import execution
from verispec.models.cache import SLOT_BLOCK
from verispec.models.layout import TAIL
from verispec.models.native import EXACT_ROWS, NativeModel, load_default, load_model
from verispec.models.packed import packing

SEQ = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))  # in chunks: 16 + 16 + 8 rows
PREFIX = 10
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine (exactness was also checked with two)."""


# Every precision on every kernel family that runs it: float32 and bfloat16 on verispec's kernels (matmul and
# `VisibleSlots` attention) and on PyTorch's (oneDNN, `FixedWidthKeys`), float32 over a float16 cache on both; the
# block formats (a float16 cache by default) on verispec's only.
F16_CACHE = "float32-float16-cache"
SETTINGS = [
    (torch.float32, True),
    (torch.float32, False),
    (torch.bfloat16, True),
    (torch.bfloat16, False),
    (F16_CACHE, True),
    (F16_CACHE, False),
    *((fmt, True) for fmt in FORMATS),
]


@pytest.fixture(
    scope="module",
    params=SETTINGS,
    ids=[f"{str(p).removeprefix('torch.')}-{'own' if own else 'torch'}-kernels" for p, own in SETTINGS],
)
def setting(request: pytest.FixtureRequest) -> tuple[torch.dtype | str, bool]:
    if request.param[1] and not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    return request.param


def exact_on(pair_dirs: tuple[Path, Path], precision: torch.dtype | str, own_kernels: bool) -> NativeModel:
    """The target in exact mode, in a float dtype or a block format (float32 activations), packed on verispec's
    kernels or PyTorch's."""
    if precision in FORMATS:
        model = load_model(pair_dirs[0], exact=True, quantize=precision)
        assert model.kv_dtype == torch.float16
    elif precision == F16_CACHE:
        model = load_model(pair_dirs[0], exact=True, fast=False, kv_dtype="float16")
    else:
        model = load_model(pair_dirs[0], dtype=precision, exact=True, fast=False)
    model.pack(EXACT_ROWS, own_kernels)
    return model


@pytest.fixture(scope="module")
def exact(pair_dirs: tuple[Path, Path], setting: tuple[torch.dtype | str, bool]) -> NativeModel:
    return exact_on(pair_dirs, *setting)


@pytest.fixture(scope="module")
def exact_torch(pair_dirs: tuple[Path, Path], dtype: torch.dtype) -> NativeModel:
    return exact_on(pair_dirs, dtype, own_kernels=False)


@pytest.fixture(scope="module")
def exact_own(pair_dirs: tuple[Path, Path], dtype: torch.dtype) -> NativeModel:
    if not kernels.available(dtype):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    return exact_on(pair_dirs, dtype, own_kernels=True)


@pytest.fixture(params=["long", "short"], ids=["long-chunks", "short-chunks"])
def chunks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verispec's attention runs LONG_ROWS-row chunks, or, here, as short ones as PyTorch's (EXACT_ROWS), so that
    chunk boundaries fall inside the forwards of these tests on either kernels."""
    if request.param == "short":
        monkeypatch.setattr(execution, "LONG_ROWS", EXACT_ROWS)


@pytest.fixture
def short_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execution, "LONG_ROWS", EXACT_ROWS)


@pytest.fixture(scope="module")
def seq_alone(exact: NativeModel) -> torch.Tensor:
    with torch_threads(1):
        return alone(exact)


def alone(model: NativeModel, tokens: torch.Tensor = SEQ) -> torch.Tensor:
    """Logits (T, V) of plain decoding: one forward per token."""
    cache = model.new_cache()
    return torch.cat([model(tokens[:, i : i + 1], cache)[0] for i in range(tokens.shape[1])])


def after_prefix(
    model: NativeModel, tokens: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits (T, V) of one forward of `tokens` after SEQ[:PREFIX] in the cache."""
    cache = model.new_cache()
    model(SEQ[:, :PREFIX], cache)
    return model(tokens, cache, mask, None if positions is None else positions + PREFIX)[0]


def tree(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (T, T) and depths (T,) of a tree whose node i has parent parents[i] (-1: a root)."""
    mask, depths = torch.zeros(len(parents), len(parents), dtype=torch.bool), []
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return mask, torch.tensor(depths)


def paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root, as node indices."""
    out: list[list[int]] = []
    for i, parent in enumerate(parents):
        out.append(([] if parent < 0 else out[parent]) + [i])
    return out


# --- a position's logits, however many tokens share the forward --------------------------------------------------


def test_every_row_of_a_prefill_equals_the_position_alone(
    exact: NativeModel, seq_alone: torch.Tensor, chunks: None
) -> None:
    cache = exact.new_cache()
    assert torch.equal(exact(SEQ, cache)[0], seq_alone)  # rows of the first, a middle and the padded last chunk
    assert cache.length == SEQ.shape[1]


@pytest.mark.parametrize("n", [2, 5, EXACT_ROWS + 3])
def test_every_row_of_a_chain_equals_the_position_alone(
    exact: NativeModel, seq_alone: torch.Tensor, n: int, short_chunks: None
) -> None:
    assert torch.equal(after_prefix(exact, SEQ[:, PREFIX : PREFIX + n]), seq_alone[PREFIX : PREFIX + n])


# Two roots' worth of branching: [r, a, b, a1, b1, c, a2, b2], paths r-a-a1-a2, r-b-b1-b2 and r-c.
PARENTS = [-1, 0, 0, 1, 2, 0, 3, 4]


def test_every_node_of_a_tree_equals_its_path_decoded_alone(exact: NativeModel) -> None:
    tokens = torch.tensor([[int(SEQ[0, PREFIX]), 70, 71, 80, 81, 90, 82, 83]])
    mask, depths = tree(PARENTS)
    logits = after_prefix(exact, tokens, mask, depths)
    for node, path in enumerate(paths(PARENTS)):
        plain = alone(exact, torch.cat((SEQ[:, :PREFIX], tokens[:, path]), dim=1))
        assert torch.equal(logits[node], plain[-1]), f"node {node}"


def test_a_tree_wider_than_the_rows_runs_in_chunks(exact: NativeModel, short_chunks: None) -> None:
    parents = [-1] + [0] * 19 + list(range(1, 6))  # 20 children of the root, then a grandchild under 5 of them
    tokens = torch.randint(0, 256, (1, len(parents)), generator=torch.Generator().manual_seed(3))
    mask, depths = tree(parents)
    logits = after_prefix(exact, tokens, mask, depths)
    for node in (0, 7, 19, 22, 24):
        plain = alone(exact, torch.cat((SEQ[:, :PREFIX], tokens[:, paths(parents)[node]]), dim=1))
        assert torch.equal(logits[node], plain[-1]), f"node {node}"


def test_a_tree_past_the_tail_width_equals_its_paths_decoded_alone(exact: NativeModel) -> None:
    """After 36 tokens a node's keys split between the cache slots used in place (positions below its last TAIL)
    and the gathered tail: its last TAIL positions, committed tokens, the root and its ancestors (out of place)."""
    start = 36
    tokens = torch.tensor([[int(SEQ[0, start]), 70, 71, 80, 81, 90, 82, 83]])
    mask, depths = tree(PARENTS)
    cache = exact.new_cache()
    exact(SEQ[:, :start], cache)
    logits = exact(tokens, cache, mask, depths + start)[0]
    for node, path in enumerate(paths(PARENTS)):
        plain = alone(exact, torch.cat((SEQ[:, :start], tokens[:, path]), dim=1))
        assert torch.equal(logits[node], plain[-1]), f"node {node}"


def test_a_tree_may_be_as_deep_as_the_tail_and_no_deeper_on_torch_kernels(exact_torch: NativeModel) -> None:
    """A branch under the root's second child sits one slot past its positions: its keys are out of place.
    `FixedWidthKeys` gathers a row's last TAIL keys into place, so on PyTorch's kernels a deeper branch is refused."""
    exact = exact_torch
    parents = [-1, 0, 0] + list(range(2, 2 + TAIL - 1))  # the deepest node is TAIL deep
    tokens = torch.randint(0, 256, (1, len(parents) + 1), generator=torch.Generator().manual_seed(4))
    cache = exact.new_cache()
    exact(SEQ[:, :PREFIX], cache)
    mask, depths = tree(parents)
    deepest = exact(tokens[:, :-1], cache, mask, depths + PREFIX)[0, -1]
    assert torch.equal(deepest, alone(exact, torch.cat((SEQ[:, :PREFIX], tokens[:, paths(parents)[-1]]), 1))[-1])
    cache.truncate(PREFIX)
    mask, depths = tree(parents + [len(parents) - 1])
    with pytest.raises(ValueError, match=f"more than {TAIL} deep"):
        exact(tokens, cache, mask, depths + PREFIX)
    assert cache.length == PREFIX


def test_own_kernels_take_a_tree_of_any_depth(exact_own: NativeModel) -> None:
    """`VisibleSlots` skips the slots a row does not see, so a branch 40 deep, one slot past its positions, is exact."""
    exact = exact_own
    parents = [-1, 0, 0] + list(range(2, 2 + TAIL + 7))
    tokens = torch.randint(0, 256, (1, len(parents)), generator=torch.Generator().manual_seed(4))
    mask, depths = tree(parents)
    deepest = after_prefix(exact, tokens, mask, depths)[-1]
    assert torch.equal(deepest, alone(exact, torch.cat((SEQ[:, :PREFIX], tokens[:, paths(parents)[-1]]), 1))[-1])


def test_a_mask_covering_the_cache_as_a_draft_tree_passes_it(exact: NativeModel) -> None:
    """Depth by depth, as the draft model scores its tree: each forward's mask (T, cache.length + T) says which
    of the earlier tree nodes in the cache each new node sees."""
    cache = exact.new_cache()
    exact(SEQ[:, :PREFIX], cache)
    first = exact(
        torch.tensor([[5, 6]]),
        cache,
        positions=torch.tensor([PREFIX, PREFIX]),
        mask=torch.tensor([[True] * PREFIX + [True, False], [True] * PREFIX + [False, True]]),
    )[0]
    second = exact(
        torch.tensor([[7]]),
        cache,
        positions=torch.tensor([PREFIX + 1]),  # under the second node
        mask=torch.tensor([[True] * PREFIX + [False, True, True]]),
    )[0]
    assert torch.equal(first[1], alone(exact, torch.cat((SEQ[:, :PREFIX], torch.tensor([[6]])), 1))[-1])
    assert torch.equal(second[0], alone(exact, torch.cat((SEQ[:, :PREFIX], torch.tensor([[6, 7]])), 1))[-1])


def test_two_threads_are_exact_too(exact: NativeModel) -> None:
    """Which thread takes a row must not matter (it does in torch's fused float32 attention, which exact mode
    avoids)."""
    with torch_threads(2):
        whole, cache = exact(SEQ[:, :18], exact.new_cache())[0], exact.new_cache()
        halves = torch.cat((exact(SEQ[:, :9], cache)[0], exact(SEQ[:, 9:18], cache)[0]))  # rows 9..15 become 0..6
    assert torch.equal(whole, halves)


def test_exact_mode_takes_the_fast_path_by_default(pair_dirs: tuple[Path, Path], dtype: torch.dtype) -> None:
    """So the tests here check the prepacked, fused matmuls (laid out for exact mode's rows), on verispec's kernels
    where this machine has them, for batch invariance."""
    model = load_model(pair_dirs[0], dtype=dtype, exact=True)
    assert model.module.head is not None and model.module.head.rows == EXACT_ROWS
    assert all(block.self_attn.qkv is not None and block.mlp.gate_up is not None for block in model.module.model.layers)
    assert packing(model.module).kernels == kernels.available(dtype)


def test_the_plain_kernels_are_exact_too(pair_dirs: tuple[Path, Path], dtype: torch.dtype) -> None:
    plain = load_model(pair_dirs[0], dtype=dtype, exact=True, fast=False)
    assert torch.equal(plain(SEQ, plain.new_cache())[0], alone(plain))


def test_the_ordinary_path_differs_where_exact_mode_does_not(pair_dirs: tuple[Path, Path]) -> None:
    """Without exact mode, on PyTorch's kernels, bfloat16 logits change with the forward's width: the tests above
    can fail."""
    ordinary = load_model(pair_dirs[0], dtype=torch.bfloat16, fast=False)
    ordinary.pack(1, own_kernels=False)
    assert not torch.equal(ordinary(SEQ, ordinary.new_cache())[0], alone(ordinary))


# --- the static cache and its limits -----------------------------------------------------------------------------


def test_the_static_cache_is_zeroed_and_spans_the_context_plus_padding(exact: NativeModel) -> None:
    """On PyTorch's kernels; on verispec's, which read only the slots a row sees, the cache grows as any other."""
    cache = exact.new_cache(24)
    assert cache.rows == EXACT_ROWS and cache.width >= exact.context_length + EXACT_ROWS
    if packing(exact.module).attention:
        assert cache.grows and cache.k.shape[3] == cache.slots == SLOT_BLOCK
    else:
        assert cache.k.shape[3] == cache.width and not cache.k.any() and not cache.v.any()
    assert cache.max_len == 24  # what it may hold is unchanged: only storage and attention width grow
    exact(SEQ[:, :24], cache)
    with pytest.raises(ContextLengthError):
        exact(SEQ[:, :1], cache)


def test_a_token_may_not_see_a_later_chunk(exact: NativeModel, short_chunks: None) -> None:
    mask = torch.ones(EXACT_ROWS + 1, EXACT_ROWS + 1, dtype=torch.bool)  # every token sees every other
    cache = exact.new_cache()
    with pytest.raises(ValueError, match="later chunk"):
        exact(SEQ[:, : EXACT_ROWS + 1], cache, mask)
    assert cache.length == 0


def test_layer_skip_forwards_and_rollback_keep_positions_exact(exact: NativeModel) -> None:
    """A layer-skipped draft, then truncate and verify, as layer skip drafting does, then keep of a tree branch."""
    cache = exact.new_cache()
    exact(SEQ[:, :PREFIX], cache)
    exact(SEQ[:, PREFIX : PREFIX + 3], cache, layers=[0, 2])  # stale entries in layer 1, truncated away
    cache.truncate(PREFIX)
    tokens = torch.tensor([[int(SEQ[0, PREFIX]), 70, 71, 80, 81, 90, 82, 83]])
    mask, depths = tree(PARENTS)
    exact(tokens, cache, mask, depths + PREFIX)
    cache.keep(PREFIX, [0, 2, 4, 7])  # the path r-b-b1-b2 moves into place
    nxt = exact(torch.tensor([[5]]), cache)[0, -1]
    path = torch.cat((SEQ[:, :PREFIX], tokens[:, [0, 2, 4, 7]], torch.tensor([[5]])), 1)
    assert torch.equal(nxt, alone(exact, path)[-1])


# --- greedy speculative decoding is bit-identical to plain decoding ----------------------------------------------

PROMPT = list(b"def main(x):\n    return x + main(x)")

METHODS = {
    "draft_chain": lambda draft: DraftModel(draft, 4),
    "draft_tree": lambda draft: DraftModel(draft, 3, branch=2, branch_depth=2),
    "prompt_lookup": lambda draft: PromptLookup(4),
    "layer_skip": lambda draft: LayerSkip([1], 3),
    "lookahead": lambda draft: Lookahead(window=4, ngram=3, candidates=3),
    "suffix": lambda draft: SuffixDecoding(4),
    "suffix_tree": lambda draft: SuffixDecoding(4, tree_tokens=6),
}


@pytest.fixture(scope="module")
def bf16_pair(pair_dirs: tuple[Path, Path]) -> tuple[NativeModel, NativeModel]:
    return (
        load_model(pair_dirs[0], dtype=torch.bfloat16, exact=True),
        load_model(pair_dirs[1], dtype=torch.bfloat16),
    )  # the draft runs ordinarily, as the CLI loads it


@pytest.fixture(scope="module")
def bf16_plain(bf16_pair: tuple[NativeModel, NativeModel]) -> list[int]:
    with torch_threads(1):
        return generate(bf16_pair[0], PROMPT, max_new_tokens=40, ignore_eos=True).tokens


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_is_identical_to_plain_decoding_in_bfloat16(
    bf16_pair: tuple[NativeModel, NativeModel], bf16_plain: list[int], method: str
) -> None:
    target, draft = bf16_pair
    result = generate(target, PROMPT, METHODS[method](draft), max_new_tokens=40, ignore_eos=True)
    assert result.tokens == bf16_plain
    assert result.stats.target_calls < 40 or method.startswith(("prompt_lookup", "suffix"))  # speculation did happen


def test_shipped_pair_greedy_identity_in_bfloat16() -> None:
    target, draft = load_default(dtype="bfloat16", exact=True)
    prompt = "def read_lines(path):\n"
    plain = generate(target, prompt, max_new_tokens=8, ignore_eos=True)
    for drafter in (DraftModel(draft, 4), DraftModel(draft, 2, branch=2)):
        assert generate(target, prompt, drafter, max_new_tokens=8, ignore_eos=True).tokens == plain.tokens


def test_hidden_states_come_back_through_the_chunks(
    exact: NativeModel, seq_alone: torch.Tensor, short_chunks: None
) -> None:
    logits, hidden = exact(SEQ, exact.new_cache(), hidden=[0, -1])
    assert torch.equal(logits[0], seq_alone) and hidden.shape == (1, SEQ.shape[1], 2, exact.hidden_size)
    cache = exact.new_cache()
    exact(SEQ[:, :PREFIX], cache)
    assert torch.equal(exact(SEQ[:, PREFIX : PREFIX + 1], cache, hidden=[0, -1])[1][0, 0], hidden[0, PREFIX])


@pytest.mark.parametrize("keep", [1, 3, EXACT_ROWS + 2, 100])
def test_logits_to_keep_gives_the_last_rows_bitwise(
    exact: NativeModel, seq_alone: torch.Tensor, keep: int, chunks: None
) -> None:
    """Chunks before the rows kept skip the LM head; the rest give the same bits as a full forward's."""
    cache = exact.new_cache()
    logits, hidden = exact(SEQ, cache, hidden=[-1], logits_to_keep=keep)
    assert torch.equal(logits[0], seq_alone[-keep:]) and cache.length == SEQ.shape[1]
    assert torch.equal(hidden, exact(SEQ, exact.new_cache(), hidden=[-1])[1])
    cache.truncate(PREFIX)
    assert torch.equal(exact(SEQ[:, PREFIX:], cache, logits_to_keep=keep)[0], seq_alone[PREFIX:][-keep:])
