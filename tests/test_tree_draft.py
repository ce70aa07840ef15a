"""Token-tree drafting with a draft model: greedy identity, the draft's tree forward and cache compaction,
SpecInfer's multi-candidate rule on trees (statistically, with broken variants that must fail), and sampling
end to end through `generate`."""

from __future__ import annotations

import copy
from typing import NamedTuple

import numpy as np
import pytest
import torch
from scipy import stats

from drafting import start_session
from verispec import DraftModel, InvalidArgumentError, Proposal, Verdict, generate
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main
from verispec.drafters.draft_model import DraftModelSession, tree_size
from verispec.models.native import NativeModel, load_model
from verispec.models.protocol import Capabilities
from verispec.sampling import SamplingParams, logits_to_probs, sample
from verispec.tree import verify_tree

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------------
# construction and greedy identity


def test_tree_shape_and_bad_arguments(draft) -> None:
    assert DraftModel(draft, k=4, branch=2).width == tree_size(4, 2, 1) == 2 + 2 + 2 + 2
    assert DraftModel(draft, k=3, branch=3, branch_depth=2).width == 3 + 9 + 9
    assert DraftModel(draft, k=4).width == 4
    for bad in ({"branch": 0}, {"branch_depth": 0}, {"k": 0, "branch": 2}):
        with pytest.raises(InvalidArgumentError):
            DraftModel(draft, **bad)


def test_branching_needs_the_native_runtime(draft) -> None:
    class Adapted:  # stands in for a TransformersModel: same protocol, no tree masks
        name, capabilities = "hf-draft", Capabilities()

    with pytest.raises(InvalidArgumentError, match="native runtime"):
        DraftModel(Adapted(), k=4, branch=2)
    DraftModel(Adapted(), k=4)  # a chain is fine


@pytest.mark.parametrize("k, branch, branch_depth", [(1, 2, 1), (4, 2, 1), (3, 3, 2)])
@pytest.mark.parametrize("which", ["self", "partial", "unrelated"])
def test_tree_drafting_is_identical_to_greedy(target, draft, unrelated, which, k, branch, branch_depth) -> None:
    """Token-identical to autoregressive decoding with the target itself, its first layer, and an unrelated model;
    with the target as its own draft every proposal's first branch is accepted whole (k + 1 tokens a step)."""
    model = {"self": target, "partial": draft, "unrelated": unrelated}[which]
    truth = generate(target, PROMPT, max_new_tokens=30, ignore_eos=True).tokens
    result = generate(target, PROMPT, DraftModel(model, k, branch, branch_depth), max_new_tokens=30, ignore_eos=True)
    assert result.tokens == truth
    if which == "self":
        assert result.stats.target_calls == -(-30 // (k + 1))


def test_cli_generate_with_branch(capsys, pair_dirs) -> None:
    target, draft = map(str, pair_dirs)
    code = main(
        [
            "generate",
            "def f(x):",
            "--target",
            target,
            "--draft",
            draft,
            "-k",
            "3",
            "--branch",
            "2",
            "--branch-depth",
            "2",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--color",
            "never",
            "--compare",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and "16 tokens" in out and "identical to autoregressive: yes" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--branch", "0"], "branch (candidates per tree node) must be an integer >= 1"),
        (["--branch-depth", "-1"], "branch_depth (depths that branch) must be an integer >= 1"),
        (["--branch", "2", "--method", "ngram"], "method ngram takes no option branch"),
        (["--branch", "2", "--no-draft"], "method draft needs a draft model (--draft DIR)"),
        (["--branch", "2", "--backend", "transformers"], "native runtime"),
    ],
)
def test_cli_rejects_bad_branch_options(capsys, pair_dirs, extra, message) -> None:
    target, draft = map(str, pair_dirs)
    draft_args = [] if "--no-draft" in extra else ["--draft", draft]
    extra = [a for a in extra if a != "--no-draft"]
    code = main(["generate", "x", "--target", target, *draft_args, "--max-new-tokens", "4", *extra])
    out, err = capsys.readouterr()
    last = err.rstrip("\n").split("\n")[-1]  # transformers' loading bar may come first
    assert code == 2 and out == "" and last.startswith("verispec: error: ") and message in last, err


def test_verdicts_after_an_end_of_sequence_cut_are_in_the_drafters_numbering(target) -> None:
    """The loop drops the nodes beneath an end-of-sequence token, which renumbers the tree; the verdict it hands
    back must still name the drafter's own nodes. The target drafts for itself, so every path runs to depth k."""
    probe = start_session(DraftModel(target, k=3, branch=2), target, PROMPT)
    eos = frozenset({probe.propose(PROMPT, 3).tokens[1]})  # the second candidate for the first token ends the text
    eos_target = copy.copy(target)
    eos_target.eos_token_ids = eos
    truth = generate(eos_target, PROMPT, max_new_tokens=30).tokens
    verdicts = []

    class CheckingSession(DraftModelSession):
        def propose(self, context, k) -> Proposal:
            self.at, self.proposal = len(context) - len(PROMPT), super().propose(context, k)
            return self.proposal

        def accepted(self, verdict: Verdict) -> None:
            verdicts.append((self.at, [self.proposal.tokens[i] for i in verdict.path], verdict.path))
            super().accepted(verdict)

    class Checking(DraftModel):
        def begin(self, context):
            return CheckingSession(self, context)

    assert generate(eos_target, PROMPT, Checking(target, k=3, branch=2), max_new_tokens=30).tokens == truth
    assert verdicts[0][2] == [0, 2, 4]  # nodes 3 and 5 (beneath the EOS at node 1) were cut before verification
    assert all(tokens == truth[at : at + len(tokens)] for at, tokens, _ in verdicts)


# ---------------------------------------------------------------------------------------------------------------
# the draft's own tree forward and cache


class Recorder(DraftModel):
    """A DraftModel whose session checks, after every verdict, that its cache holds exactly what a plain forward
    over the committed tokens it has seen would hold; counts the verdicts whose entries had to move and those that
    took a sibling other than the first."""

    moved = second_choice = steps = 0

    def begin(self, context):
        return RecorderSession(self, context)


class RecorderSession(DraftModelSession):
    def __init__(self, recorder: Recorder, context) -> None:
        super().__init__(recorder, context)
        self.recorder = recorder

    def propose(self, context, k) -> Proposal:
        self.context, self.proposal = list(context), super().propose(context, k)
        return self.proposal

    def accepted(self, verdict: Verdict) -> None:
        parents, recorder = self.proposal.parents, self.recorder
        recorder.moved += any(self._slots.get(i, j) != j for j, i in enumerate(verdict.path))
        recorder.second_choice += any(parents.index(parents[i]) != i for i in verdict.path)  # not the first sibling
        recorder.steps += 1
        super().accepted(verdict)
        committed = self.context + [self.proposal.tokens[i] for i in verdict.path]
        seen = self.cache.length
        assert len(committed) - 1 <= seen <= len(committed)  # at most the last accepted token is unseen
        plain = self.model.new_cache()
        self.model(torch.tensor([committed[:seen]]), plain)
        torch.testing.assert_close(self.cache.k[..., :seen, :], plain.k[..., :seen, :], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(self.cache.v[..., :seen, :], plain.v[..., :seen, :], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def deep_unrelated(tmp_path_factory: pytest.TempPathFactory) -> NativeModel:
    """Two layers, so that the second layer's keys and values depend on what the tree mask let each node see."""
    return load_model(random_checkpoint(tmp_path_factory.mktemp("deep"), tiny_config(num_hidden_layers=2), seed=5))


@pytest.mark.parametrize("which, temperature", [("partial", 0.0), ("deep_unrelated", 1.0)])
def test_draft_cache_after_compaction_equals_a_plain_forward(target, draft, deep_unrelated, which, temperature) -> None:
    recorder = Recorder(draft if which == "partial" else deep_unrelated, k=3, branch=2, branch_depth=2)
    generate(target, PROMPT, recorder, max_new_tokens=30, temperature=temperature, seed=0, ignore_eos=True)
    assert recorder.steps > 3 and recorder.moved > 0  # some accepted paths had to be moved into place
    assert temperature == 0 or recorder.second_choice > 0  # sampled siblings: the second is sometimes taken


def test_tree_rows_are_the_draft_distribution_at_each_parent(target, draft) -> None:
    """Under sampling each node's row of q is the draft's own next-token distribution after the committed text
    and the node's ancestors, as a plain forward computes it: the frontier's tree mask and positions are right."""
    sampling = SamplingParams(1.0)
    drafter = DraftModel(draft, k=3, branch=2, branch_depth=2)
    proposal = start_session(drafter, target, PROMPT, sampling, torch.Generator().manual_seed(0)).propose(PROMPT, 3)
    assert len(proposal.tokens) == 2 + 4 + 4 and proposal.q.shape == (10, draft.vocab_size)
    assert proposal.parents == [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    for node, parent in enumerate(proposal.parents):
        path = []
        while parent >= 0:
            path, parent = [proposal.tokens[parent], *path], proposal.parents[parent]
        logits = draft(torch.tensor([PROMPT + path]), draft.new_cache())[0, -1, : draft.vocab_size]
        torch.testing.assert_close(proposal.q[node], logits_to_probs(logits, sampling), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# SpecInfer's rule on a two-deep tree, at the rule level
#
# b first tokens drawn from q1, each with one child drawn from q2 given it; the first two tokens of the outcome
# (path, then the target's token) must be distributed as p1(x1) p2(x2 | x1).

V = 5
DRAWS = 10_000
CELLS = V * V
TV_THRESHOLD = (CELLS / DRAWS) ** 0.5  # 0.05: E[TV] <= 0.4 sqrt(CELLS / DRAWS), as in test_verify.py
# Measured: the real rule p 0.57-0.99, TV 0.005-0.017; keeping p between siblings p < 1e-186, TV 0.074-0.17;
# distinct siblings p ~ 0, TV 0.23.
P_VALUE_MIN = 1e-3


class Tables(NamedTuple):
    p1: torch.Tensor  # (V,) target at the root
    p2: torch.Tensor  # (V, V) target after each first token
    q1: torch.Tensor | None  # draft at the root; None: deterministic candidates (one-hot q)
    q2: torch.Tensor | None
    logits1: torch.Tensor
    logits2: torch.Tensor
    sampling: SamplingParams


def tables(kind: str, sampling: SamplingParams) -> Tables:
    gen = torch.Generator().manual_seed(7)
    logits1, logits2 = torch.randn(V, generator=gen), torch.randn(V, V, generator=gen)
    p1, p2 = logits_to_probs(logits1, sampling), logits_to_probs(logits2, sampling)
    if kind == "one_hot":
        return Tables(p1, p2, None, None, logits1, logits2, sampling)
    q1, q2 = (p1, p2) if kind == "equal" else (torch.softmax(2 * torch.randn(n, V, generator=gen), -1) for n in (1, V))
    return Tables(p1, p2, q1.reshape(V), q2, logits1, logits2, sampling)


def draw_trees(t: Tables, branch: int, distinct: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(DRAWS, branch) first tokens and (DRAWS, branch) their children; i.i.d. from q unless `distinct`."""
    if t.q1 is None:  # deterministic: the tokens 0..b-1, each followed by its own successor
        first = torch.arange(branch).expand(DRAWS, branch)
        return first, (first + 1) % V
    first = torch.multinomial(t.q1.expand(DRAWS, V), branch, replacement=not distinct, generator=gen)
    return first, sample(t.q2[first], gen)


def outcome_counts(rule, t: Tables, branch: int, distinct: bool = False) -> np.ndarray:
    """Counts (V * V,) of the first two tokens over DRAWS trees verified by `rule` (verify_tree's signature)."""
    gen = torch.Generator().manual_seed(0)
    first, second = draw_trees(t, branch, distinct, gen)
    parents = [-1] * branch + list(range(branch))
    counts = np.zeros(CELLS, dtype=np.int64)
    leaf_logits = torch.zeros(branch, V)  # the bonus token after depth 2 is not counted
    for f, s in zip(first.tolist(), second.tolist()):
        probs = None if t.q1 is None else torch.cat((t.q1.expand(branch, V), t.q2[f]))
        logits = torch.cat((t.logits1[None], t.logits2[f], leaf_logits))
        proposal = Proposal(f + s, probs, parents)
        path, nxt = rule(proposal, logits, t.sampling, gen)
        out = [proposal.tokens[i] for i in path] + [nxt]
        if len(out) == 1:  # every first token rejected: the next step decodes the second from the target
            out.append(int(sample(t.p2[nxt], gen)))
        counts[out[0] * V + out[1]] += 1
    return counts


def compare(counts: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value, TV) of counts against exact probabilities; cells expected < 5 times pooled."""
    total = counts.sum()
    tv = 0.5 * float(np.abs(counts / total - exact).sum())
    if counts[exact == 0].sum() > 0:
        return 0.0, tv
    expected = exact * total
    small = expected < 5
    observed, expected = (
        np.append(counts[~small], counts[small].sum()),
        np.append(expected[~small], expected[small].sum()),
    )
    keep = expected > 0
    return float(stats.chisquare(observed[keep], expected[keep]).pvalue), tv


def rule_statistics(
    rule, kind: str, sampling: SamplingParams, branch: int, distinct: bool = False
) -> tuple[float, float]:
    t = tables(kind, sampling)
    exact = (t.p1.double()[:, None] * t.p2.double()).reshape(-1).numpy()
    return compare(outcome_counts(rule, t, branch, distinct), exact / exact.sum())


CASES = {
    "random_b2": ("random", SamplingParams(1.0), 2),
    "random_b3_topk3": ("random", SamplingParams(1.0, top_k=3), 3),
    "equal_b2": ("equal", SamplingParams(0.8), 2),
    "one_hot_b2_topk3": ("one_hot", SamplingParams(1.0, top_k=3), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_specinfer_rule_on_trees_keeps_the_target_distribution(case: str) -> None:
    pvalue, tv = rule_statistics(verify_tree, *CASES[case])
    assert pvalue > P_VALUE_MIN, (pvalue, tv)
    assert tv < TV_THRESHOLD, (pvalue, tv)


def no_residual_verify_tree(
    proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[list[int], int]:
    """BROKEN: SpecInfer's walk, except that a rejected sibling leaves p as it was for the next one."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(proposal.parents):
        children.setdefault(parent, []).append(i)
    path, node = [], -1
    while True:
        p, child = logits_to_probs(logits[node + 1], sampling), None
        for c in children.get(node, []):
            x = proposal.tokens[c]
            qx = 1.0 if proposal.q is None else float(proposal.q[c, x])
            if float(torch.rand((), generator=generator)) * qx < float(p[x]):
                child = c
                break
        if child is None:
            return path, int(sample(p, generator))
        path.append(child)
        node = child


@pytest.mark.parametrize("case", ["random_b2", "one_hot_b2_topk3"])
def test_a_rule_that_keeps_p_between_siblings_fails_the_same_check(case: str) -> None:
    pvalue, tv = rule_statistics(no_residual_verify_tree, *CASES[case])
    assert pvalue < 1e-6 and tv > TV_THRESHOLD, (pvalue, tv)


def test_siblings_drawn_without_replacement_fail_the_same_check() -> None:
    """Distinct siblings sampled from q are not what the rule's q rows describe: the drafter must draw i.i.d."""
    pvalue, tv = rule_statistics(verify_tree, "random", SamplingParams(1.0), 2, distinct=True)
    assert pvalue < 1e-6 and tv > TV_THRESHOLD, (pvalue, tv)


# ---------------------------------------------------------------------------------------------------------------
# end to end through `generate`

E2E_VOCAB = 6
E2E_PROMPT = [1, 4, 2]
E2E_DRAWS = 2000  # about 4 ms per three-token generation on a quiet 2-core machine, 8 ms on a busy one


class TinyModels(NamedTuple):
    target: NativeModel
    draft: NativeModel
    joint: np.ndarray  # (V, V) exact target probability of the next two tokens after E2E_PROMPT
    target_first: np.ndarray  # (V,)
    draft_first: np.ndarray  # (V,)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, reference_probs) -> TinyModels:
    folder = tmp_path_factory.mktemp("tiny_tree")
    config = tiny_config(vocab_size=E2E_VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    target_dir = random_checkpoint(folder / "target", config, seed=1)
    draft_dir = random_checkpoint(folder / "draft", config, seed=3)  # a1 0.52: room for a second candidate
    contexts = np.array([E2E_PROMPT + [x] for x in range(E2E_VOCAB)])
    target_probs = reference_probs(target_dir, contexts)  # (V, len + 1, V)
    joint = target_probs[0, -2][:, None] * target_probs[:, -1]
    draft_first = reference_probs(draft_dir, contexts[:1])[0, -2]
    return TinyModels(load_model(target_dir), load_model(draft_dir), joint, target_probs[0, -2], draft_first)


def test_generate_with_a_draft_tree_follows_the_target_distribution(tiny_models: TinyModels) -> None:
    """Three new tokens with DraftModel(k=2, branch=2): the first step verifies two sampled first tokens, each
    with a sampled child; the first two new tokens are distributed exactly as under the target, and the first
    token comes from the tree at SpecInfer's rate a1 + (1 - a1) a2, above a chain's a1."""
    m = tiny_models
    counts = np.zeros((E2E_VOCAB, E2E_VOCAB), dtype=np.int64)
    first_drafted = 0
    drafter = DraftModel(m.draft, k=2, branch=2)
    for seed in range(E2E_DRAWS):
        out = generate(m.target, E2E_PROMPT, drafter, max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
        counts[out.tokens[0], out.tokens[1]] += 1
        first_drafted += out.drafted[0]
    pvalue, tv = compare(counts.ravel(), m.joint.ravel())
    assert pvalue > P_VALUE_MIN, (pvalue, tv)
    assert tv < (m.joint.size / E2E_DRAWS) ** 0.5, (pvalue, tv)  # 0.13; as for TV_THRESHOLD
    p, q = m.target_first, m.draft_first
    a1 = np.minimum(p, q).sum()
    residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
    rate = a1 + (1 - a1) * np.minimum(residual, q).sum()
    assert 0.3 < a1 < rate - 0.15  # the second candidate adds a lot (0.52 -> 0.74)
    sigma = (rate * (1 - rate) / E2E_DRAWS) ** 0.5
    assert abs(first_drafted / E2E_DRAWS - rate) < 5 * sigma, (first_drafted / E2E_DRAWS, rate)
