"""Token trees: mask and positions, pruning after EOS, cache compaction, and the greedy tree walk end to end."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from drafting import OwnSession
from verispec import DrafterError, Proposal, SideBranch, Verdict, generate
from verispec.drafters.base import Needs
from verispec.models.cache import KVCache
from verispec.sampling import SamplingParams
from verispec.tree import cut_after_eos, depths, layout, verify_tree

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]


def test_layout_sees_root_ancestors_and_self_only() -> None:
    # root -> 0 -> 2, root -> 1; a side branch of two tokens, the second seeing the first
    side = SideBranch([7, 8], [1, 2], torch.tensor([[True, False], [True, True]]))
    mask, positions = layout(Proposal([5, 6, 9], parents=[-1, -1, 0], side=side), 10, torch.device("cpu"))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # token 0
            [1, 0, 1, 0, 0, 0],  # token 1: not its sibling
            [1, 1, 0, 1, 0, 0],  # token 2: its parent 0
            [1, 0, 0, 0, 1, 0],  # side 0: nothing of the proposal
            [1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert positions.tolist() == [10, 11, 11, 12, 11, 12]
    assert layout(Proposal([5, 6]), 10, torch.device("cpu")) == (None, None)


def test_parents_must_come_first() -> None:
    with pytest.raises(ValueError, match="parent"):
        depths([-1, 2, 0])


def test_cut_after_eos_drops_descendants_only() -> None:
    eos = frozenset({0})
    tree, kept = cut_after_eos(Proposal([0, 5, 6, 7], torch.eye(8)[[0, 5, 6, 7]], parents=[-1, -1, 0, 1]), eos)
    assert (tree.tokens, tree.parents, kept) == ([0, 5, 7], [-1, -1, 1], [0, 1, 3])
    assert tree.q.argmax(-1).tolist() == [0, 5, 7]
    assert cut_after_eos(Proposal([3, 0, 4]), eos)[0].tokens == [3, 0]


def test_keep_moves_the_accepted_branch_into_place() -> None:
    cache = KVCache(2, 1, 1, 16, 4)
    cache.k[..., :, :] = torch.arange(float(cache.slots))[:, None]  # each slot holds its own index
    cache.v.copy_(cache.k)
    cache.length = 12
    cache.keep(5, [1, 4, 6])
    assert cache.length == 8
    assert cache.k[0, 0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 11]
    assert cache.v[1, 0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 11]


def test_greedy_walk_follows_the_argmax_child() -> None:
    logits = torch.full((4, 10), -1.0)
    logits[0, 3] = logits[2, 4] = logits[3, 9] = 1.0  # root wants 3; token 1 (a 3) wants 4; token 2 wants 9
    path, nxt = verify_tree(Proposal([2, 3, 4], parents=[-1, -1, 1]), logits, SamplingParams(), None)
    assert (path, nxt) == ([1, 2], 9)


class TreeOracle(OwnSession):
    """At every depth two siblings: a wrong token first, then the target's own; the true one goes deeper."""

    name = "tree-oracle"

    def __init__(self, truth: Sequence[int], k: int) -> None:
        self.truth, self.k, self.width, self.paths = list(truth), k, 2 * k, []

    needs = Needs(tree_masks=True)

    def start(self, context) -> None:
        self.prompt_len = len(context.prompt)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        pos, tokens, parents, parent = len(context) - self.prompt_len, [], [], -1
        for d in range(k):
            tokens += [(self.truth[pos + d] + 1) % 256, self.truth[pos + d]]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return Proposal(tokens, parents=parents)

    def accepted(self, verdict: Verdict) -> None:
        self.paths.append(verdict.path)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_tree_decoding_is_identical_to_greedy(target, k) -> None:
    truth = generate(target, PROMPT, max_new_tokens=30, ignore_eos=True).tokens
    oracle = TreeOracle(truth, k)
    result = generate(target, PROMPT, oracle, max_new_tokens=30, ignore_eos=True)
    assert result.tokens == truth
    assert result.stats.target_calls == -(-30 // (k + 1))
    assert oracle.paths[0] == [2 * d + 1 for d in range(k)]  # always the second sibling, compacted into place


class Overreaching(TreeOracle):
    """Proposes one level deeper than asked, or declares a width smaller than its trees."""

    def __init__(self, truth: Sequence[int], deeper: bool) -> None:
        super().__init__(truth, 2)
        self.deeper = deeper
        self.width = 100 if deeper else 3  # only the depth is wrong, or only the width

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        return super().propose(context, k + 1 if self.deeper else k)


@pytest.mark.parametrize("deeper", [True, False])
def test_a_drafter_that_breaks_its_bounds_is_stopped(target, deeper) -> None:
    truth = generate(target, PROMPT, max_new_tokens=12, ignore_eos=True).tokens
    with pytest.raises(DrafterError, match="at most"):
        generate(target, PROMPT, Overreaching(truth, deeper), max_new_tokens=10, ignore_eos=True)


def test_sampled_siblings_with_different_q_are_refused() -> None:
    q = torch.softmax(torch.randn(2, 10), -1)
    tree = Proposal([1, 2], q, parents=[-1, -1])
    with pytest.raises(DrafterError, match="siblings"):
        verify_tree(tree, torch.randn(3, 10), SamplingParams(1.0), torch.Generator().manual_seed(0))
    shared = Proposal([1, 2], q[[0, 0]], parents=[-1, -1])
    path, _ = verify_tree(shared, torch.randn(3, 10), SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert path in ([], [0], [1])
