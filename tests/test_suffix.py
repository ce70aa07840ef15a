"""SuffixDecoding: the suffix tree's counts against brute force, proposals (most frequent first, sized by the match,
cut by probability, k and the tree's size), the history shared across generations and threads, greedy identity on
the shipped pair, and the target's distribution under sampling through `generate`."""

from __future__ import annotations

import random

import numpy as np
import pytest

from drafting import in_threads, sampled_pairs, start_session
from test_tree_draft import no_residual_verify_tree
from test_verify import P_VALUE_MIN, compare
from verispec import InvalidArgumentError, Method, SuffixDecoding, build_drafter, generate, generate_batch, load_default
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main
from verispec.drafters.suffix import Recorded, SuffixOptions
from verispec.drafters.suffix_tree import NOTHING, Limits, SuffixTree
from verispec.models.native import load_model
from verispec.sampling import SamplingParams
from verispec.tree import depth

pytestmark = pytest.mark.usefixtures("single_thread")


def follows(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], dict[int, int]]:
    """Brute force: for every string of fewer than `depth` tokens in the texts, how often each token follows it."""
    out: dict[tuple[int, ...], dict[int, int]] = {}
    for text in texts:
        for start in range(len(text)):
            for end in range(start, min(len(text), start + depth - 1) + 1):
                after = out.setdefault(tuple(text[start:end]), {})
                if end < len(text):
                    after[text[end]] = after.get(text[end], 0) + 1
    return out


def tree_follows(tree: SuffixTree, string: tuple[int, ...]) -> dict[int, int] | None:
    position = (tree.root, 0)
    for token in string:
        position = tree._step(position, token)
        if position is None:
            return None
    following, total = tree._next(position, len(string))
    assert total == sum(count for _, count, _ in following)
    return {token: count for token, count, _ in following}


def check_counts(tree: SuffixTree, texts: list[list[int]]) -> None:
    expected = follows(texts, tree.depth)
    for string, after in expected.items():
        assert tree_follows(tree, string) == after, string
    assert tree.tokens == sum(map(len, texts))


@pytest.mark.parametrize("seed", range(40))
def test_counts_match_brute_force_with_interleaved_sequences(seed) -> None:
    rng = random.Random(seed)
    depth, alphabet = rng.choice([(3, 2), (5, 3), (6, 2)])
    tree = SuffixTree(depth)
    sequences = [tree.sequence() for _ in range(rng.randint(1, 3))]
    for _ in range(40):
        tree.extend(rng.choice(sequences), [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))])
    check_counts(tree, [s.tokens for s in sequences])
    assert tree_follows(tree, (alphabet,)) is None  # a token never seen


def unpruned(tree: SuffixTree, pattern: list[int], limits: Limits):
    """The best candidate over every match, each grown (what `speculate` gives, without its pruning)."""
    best = NOTHING
    for n, position in tree.matches(pattern):
        candidate = tree._grow(position, n, limits)
        if candidate.score > best.score:
            best = candidate
    return best


@pytest.mark.parametrize("seed", range(30))
def test_a_sequences_own_matches_and_the_pruned_search_propose_what_the_full_search_does(seed) -> None:
    """A session's own tree reads its matches from the positions its sequence keeps, and skips a match whose size
    bound cannot beat the best so far: the proposal is the one from walking every suffix and growing every match."""
    rng = random.Random(seed)
    depth, alphabet = rng.choice([(4, 2), (6, 3), (8, 2), (24, 5)])
    tree = SuffixTree(depth)
    sequence = tree.sequence()
    for _ in range(30):
        tree.extend(sequence, [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))])
        assert tree.own_matches(sequence) == tree.matches(sequence.tokens)
        limits = Limits(
            rng.choice([1, 4, 8]),
            rng.choice([2, 8]),
            rng.choice([0.5, 1.0, 2.0]),
            rng.choice([0.0, 0.1, 0.3]),
            rng.random() < 0.5,
        )
        expected = unpruned(tree, sequence.tokens, limits)
        for got in (tree.speculate(sequence.tokens, limits), tree.speculate_own(sequence, limits)):
            assert got == expected or not got.tokens and not expected.tokens  # (nothing to propose: no match kept)


def chain(tree_text, nodes=8, depth=8, factor=8.0, min_prob=0.0, tree=False):
    index = SuffixTree(6)
    index.extend(index.sequence(), tree_text)
    return index, Limits(nodes, depth, factor, min_prob, tree)


def test_the_most_frequent_continuation_with_its_probability() -> None:
    text = [1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 1, 2]  # after 1 2: 3 twice, 4 once
    index, limits = chain(text, nodes=2, factor=1.0)
    best = index.speculate(text, limits)
    assert best.match == 2 and best.tokens == [3, 1] and best.parents == [-1, 0]
    assert best.score == pytest.approx(2 / 3 + 2 / 3)  # 1 2 3 is always followed by 1
    tree = index.speculate(text, Limits(3, 2, 8.0, 0.0, True))
    assert tree.tokens == [3, 1, 4] and tree.parents == [-1, 0, -1]  # 4 (1/3) after 3 -> 1 (2/3), at depth 2
    assert tree.match == 2  # "2" alone gives the same tree: the longer match is kept


def test_size_follows_the_match_length_and_probability_cuts() -> None:
    text = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    index, _ = chain(text)
    assert index.speculate(text, Limits(8, 8, 1.0, 0.0, False)).tokens == [7, 8]  # a match of 2: 2 tokens
    assert index.speculate(text, Limits(8, 8, 2.0, 0.0, False)).tokens == [7, 8, 9, 10]
    assert index.speculate(text, Limits(3, 8, 2.0, 0.0, False)).tokens == [7, 8, 9]  # the node budget
    assert index.speculate(text, Limits(8, 2, 8.0, 0.0, False)).tokens == [7, 8]  # the depth
    split = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    index, _ = chain(split)
    assert index.speculate(split, Limits(8, 8, 8.0, 0.34, False)).tokens == []  # each third below 0.34
    tree = index.speculate(split, Limits(8, 8, 8.0, 0.3, True))
    assert len(tree.tokens) == 8 and tree.tokens[:3] == [3, 4, 5] and tree.parents[:3] == [-1, -1, -1]


def test_the_tree_is_deepest_where_likeliest_and_bounded() -> None:
    text = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    index, _ = chain(text)
    best = index.speculate(text, Limits(4, 3, 8.0, 0.0, True))
    assert best.tokens == [3, 4, 1, 5] and best.parents == [-1, 0, 1, -1]
    for nodes, deepest in ((1, 1), (3, 2), (6, 8)):
        got = index.speculate(text, Limits(nodes, deepest, 8.0, 0.0, True))
        levels = []
        for parent in got.parents:
            assert parent < len(levels)
            levels.append(1 if parent < 0 else levels[parent] + 1)
        assert len(got.tokens) <= nodes and max(levels) <= deepest
        siblings = [(p, t) for p, t in zip(got.parents, got.tokens)]
        assert len(set(siblings)) == len(siblings)  # distinct candidates under every parent


def test_drafter_proposals_respect_k_and_the_tree_size(target) -> None:
    text = [7, 8, 9, 10, 11, 12, 13, 14] * 3 + [7, 8, 9, 10, 11, 12, 13, 14, 7, 8, 9]
    for drafter, deepest, widest in (
        (SuffixDecoding(3), 3, 3),
        (SuffixDecoding(8), 8, 8),
        (SuffixDecoding(3, tree_tokens=5), 3, 5),
    ):
        session = start_session(drafter, target, text)
        for k in (1, 2, drafter.k):
            proposal = session.propose(text, k)
            assert depth(proposal) == min(k, deepest) and 1 <= len(proposal.tokens) <= widest
            assert (proposal.parents is None) == (not drafter.tree) and proposal.q is None
            assert proposal.tokens[:3] == [10, 11, 12][:k]


def test_a_second_generation_proposes_from_the_first(target) -> None:
    """The shared history: what one generation produced is proposed to the next, even with another prompt; not
    with the history off."""
    made = [30, 31, 32, 33, 34, 35, 36, 37, 38]
    for history, expected in ((SuffixOptions(), [33, 34, 35]), (SuffixOptions(history_tokens=0), [])):
        drafter = SuffixDecoding(3, options=history)
        first = start_session(drafter, target, [1, 2, 3])
        first.propose([1, 2, 3, *made], 3)  # records what it generated
        second = start_session(drafter, target, [5, 6, 30, 31, 32])
        assert second.propose([5, 6, 30, 31, 32], 3).tokens == expected


def test_the_history_keeps_its_budget_and_drops_the_oldest_half(target) -> None:
    drafter = SuffixDecoding(2, options=SuffixOptions(history_tokens=40))
    runs = [[100 + 10 * run + i for i in range(10)] for run in range(6)]
    for run in runs:
        start_session(drafter, target, [1]).propose([1, *run], 2)
        assert drafter.history.tokens <= 40
    probe = lambda run: start_session(drafter, target, [2]).propose([2, *run[:3]], 2).tokens
    assert probe(runs[-1]) == runs[-1][3:5] and probe(runs[0]) == []  # the latest kept, the oldest gone


def recording_sequences(monkeypatch) -> list:
    """(tree, sequence) for every sequence any suffix tree starts from now on."""
    recorded: list = []
    real = SuffixTree.sequence

    def sequence(self):
        made = real(self)
        recorded.append((self, made))
        return made

    monkeypatch.setattr(SuffixTree, "sequence", sequence)
    return recorded


def check_trees(recorded: list) -> None:
    """Each tree's counts are the brute-force ones of the sequences recorded in it."""
    trees = {id(tree): tree for tree, _ in recorded}
    for key, tree in trees.items():
        check_counts(tree, [s.tokens for t, s in recorded if id(t) == key])


def test_threads_record_and_speculate_on_one_history(monkeypatch) -> None:
    """Six threads record generations into one history and speculate from it, rotating it all the while."""
    recorded = recording_sequences(monkeypatch)
    drafter = SuffixDecoding(4, options=SuffixOptions(suffix_depth=5, history_tokens=600))
    limits = drafter.limits

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            recorded_as, text = Recorded(), []
            for _ in range(15):
                new = [rng.randrange(4) for _ in range(rng.randint(1, 4))]
                text += new
                drafter.history.record(recorded_as, new)
                drafter.history.speculate(text, limits)

    in_threads(work, list(range(6)))
    assert drafter.history.tokens <= 600
    check_trees(recorded)


def test_threads_and_an_engine_share_one_history(target, monkeypatch) -> None:
    """The batched engine and two threads of `generate` draft from one drafter at once, with the history rotating
    all the while: every output is the greedy one, and every tree's counts are the brute-force ones of the
    sequences recorded in it."""
    recorded = recording_sequences(monkeypatch)
    prompts = [[33, 34, 35, 36, 33, 34, 35, 36, 33], [100, 101, 102, 40, 120, 41, 58, 10, 32, 32], [7, 8, 7, 8]]
    truth = [generate(target, p, max_new_tokens=16, ignore_eos=True).tokens for p in prompts]
    drafter = SuffixDecoding(3, options=SuffixOptions(suffix_depth=6, history_tokens=120))
    failures: list[str] = []

    def work(batched: bool) -> None:
        try:
            for _ in range(3):
                if batched:
                    outs = [
                        r.tokens
                        for r in generate_batch(
                            target, prompts, drafter, max_new_tokens=16, ignore_eos=True, adaptive=False
                        )
                    ]
                else:
                    outs = [generate(target, p, drafter, max_new_tokens=16, ignore_eos=True).tokens for p in prompts]
                failures.extend(
                    f"{'engine' if batched else 'generate'}: prompt {i}"
                    for i, (out, want) in enumerate(zip(outs, truth))
                    if out != want
                )
        except Exception as error:  # noqa: BLE001 (reported below, with the threads' other failures)
            failures.append(repr(error))

    in_threads(work, [True, False, False])
    assert not failures
    assert drafter.history.tokens <= 120  # (of more than 400 generated: it rotated several times)
    check_trees(recorded)  # the history's and each generation's own


@pytest.fixture(scope="module")
def shipped():
    return load_default()[0]


@pytest.mark.parametrize(
    "method", [Method("suffix"), Method("suffix", 6, {"tree_tokens": 8}), Method("suffix", "auto")]
)
def test_greedy_identity_on_the_shipped_pair(shipped, method) -> None:
    target, drafter = shipped, build_drafter(method)
    prompt = "def area(width, height):\n    return width * height\n\n\ndef volume(width, height, depth):\n"
    truth = generate(target, prompt, max_new_tokens=48, ignore_eos=True)
    runs = [generate(target, prompt, drafter, max_new_tokens=48, ignore_eos=True) for _ in range(2)]
    assert all(run.tokens == truth.tokens for run in runs)
    assert runs[0].stats.accepted > 0
    if method.k != "auto":  # (auto's choices follow this machine's timings)
        assert runs[1].stats.target_calls < runs[0].stats.target_calls  # the first one's text, from the history


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(k=0), "k"),
        (dict(tree_tokens=0), "tree_tokens"),
        (dict(options=SuffixOptions(spec_factor=0)), "spec_factor"),
        (dict(options=SuffixOptions(min_prob=1.5)), "min_prob"),
        (dict(options=SuffixOptions(min_prob="x")), "min_prob"),
        (dict(options=SuffixOptions(suffix_depth=1)), "suffix_depth"),
        (dict(options=SuffixOptions(history_tokens=-1)), "history_tokens"),
    ],
)
def test_bad_options_are_refused(options, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        SuffixDecoding(**options)


def test_cli_suffix_matches_autoregressive_and_refuses_bad_options(capsys, pair_dirs) -> None:
    code = main(
        [
            "generate",
            "abcabcabc",
            "--target",
            str(pair_dirs[0]),
            "--method",
            "suffix",
            "--tree-tokens",
            "4",
            "--spec-factor",
            "2",
            "--min-prob",
            "0.2",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--compare",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and "identical to autoregressive: yes" in out
    assert main(["generate", "x", "--target", str(pair_dirs[0]), "--method", "suffix", "--min-prob", "2"]) == 2
    assert main(["generate", "x", "--target", str(pair_dirs[0]), "--method", "ngram", "--spec-factor", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "min_prob" in err[0] and "takes no option spec_factor" in err[1]


# ---------------------------------------------------------------------------------------------------------------
# Sampling keeps the target distribution: two new tokens over a vocabulary of 6, against exact probabilities. In
# the prompt 2 was followed by 3 and by 5: the first step verifies both, as two candidates under the root.

VOCAB = 6
PROMPT = [2, 3, 1, 2, 5, 4, 2]
DRAWS = 1500
BROKEN_DRAWS = 300  # the broken rule is far off (TV about 0.2 at any number of draws)


@pytest.fixture(scope="module")
def enumerable(tmp_path_factory, reference_probs):
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    folder = random_checkpoint(tmp_path_factory.mktemp("suffix") / "target", config, seed=3)
    probs = reference_probs(folder, np.array([PROMPT + [x] for x in range(VOCAB)]))
    first = probs[0, -2]
    return load_model(folder), first[:, None] * probs[:, -1], first


def test_sampling_through_generate_keeps_the_target_distribution(enumerable, monkeypatch) -> None:
    target, joint, first = enumerable
    drafter = SuffixDecoding(2, tree_tokens=2, options=SuffixOptions(spec_factor=2.0, history_tokens=0))
    proposal = start_session(drafter, target, PROMPT, SamplingParams(1.0)).propose(PROMPT, 1)
    assert proposal.tokens == [3, 5] and proposal.parents == [-1, -1] and proposal.q is None
    accept = first[3] + first[5]  # one-hot candidates: the rule draws without replacement from p
    assert 0.2 < accept < 0.8
    counts, drafted = sampled_pairs(target, drafter, PROMPT, DRAWS)
    pvalue, tv = compare(counts.ravel(), joint.ravel())
    assert pvalue > P_VALUE_MIN and tv < (joint.size / DRAWS) ** 0.5, (pvalue, tv)
    sigma = (accept * (1 - accept) / DRAWS) ** 0.5
    assert abs(drafted / DRAWS - accept) < 5 * sigma, (drafted / DRAWS, accept)
    import verispec.step

    monkeypatch.setattr(verispec.step, "verify_tree", no_residual_verify_tree)  # p kept between the candidates
    counts, _ = sampled_pairs(target, drafter, PROMPT, BROKEN_DRAWS)
    assert compare(counts.ravel(), joint.ravel())[0] < 1e-6


def test_the_eagle_combination_drafts_with_the_head_where_matches_are_short(tmp_path, target) -> None:
    """SAM-Decoding's combination: a long match proposes from the tree, a short one takes the head's chain; greedy
    output stays the target's."""
    import torch

    from verispec.drafters.registry import Resources
    from verispec.heads.eagle import EagleHead, head_config, save_head
    from verispec.train.loop import init_weights

    torch.manual_seed(0)
    head = EagleHead(head_config(target.config))
    init_weights(head)
    folder = save_head(head, tmp_path / "eagle", "random")
    prompt = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 9, 9]
    truth = generate(target, prompt, max_new_tokens=16, ignore_eos=True).tokens
    for below in (0, 3, 50):
        drafter = build_drafter(
            Method("suffix", 3, {"eagle_below": below, "history_tokens": 0}), Resources(target=target, head_dir=folder)
        )
        assert drafter.needs.hidden_states and not drafter.batched
        assert generate(target, prompt, drafter, max_new_tokens=16, ignore_eos=True).tokens == truth
        session = start_session(drafter, target, prompt[:9])
        proposal = session.propose(prompt[:9], 3)  # 40 41 42 matched: 3 tokens, 43 44 45 from the tree
        assert (proposal.tokens == [43, 44, 45]) == (below <= 3)


def test_the_draft_combination_drafts_with_the_model_where_matches_are_short(target, draft) -> None:
    """draft_below: a long match proposes from the tree, a short one takes the draft model's chain; greedy output
    stays the target's."""
    from verispec.drafters.draft_model import DraftModel
    from verispec.drafters.registry import Resources

    prompt = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 9, 9]
    truth = generate(target, prompt, max_new_tokens=16, ignore_eos=True).tokens
    alone = start_session(DraftModel(draft, 3), target, prompt[:9]).propose(prompt[:9], 3).tokens
    for below in (0, 3, 50):
        drafter = build_drafter(
            Method("suffix", 3, {"draft_below": below, "history_tokens": 0}), Resources(target=target, draft=draft)
        )
        assert not drafter.needs.hidden_states and not drafter.batched
        assert generate(target, prompt, drafter, max_new_tokens=16, ignore_eos=True).tokens == truth
        proposal = start_session(drafter, target, prompt[:9]).propose(prompt[:9], 3)  # 40 41 42 matched: 3 tokens
        assert proposal.tokens == ([43, 44, 45] if below <= 3 else alone)
    with pytest.raises(InvalidArgumentError, match="eagle_below or draft_below"):
        build_drafter(Method("suffix", 3, {"draft_below": 2, "eagle_below": 2}), Resources(target=target, draft=draft))
    with pytest.raises(InvalidArgumentError, match="vocab_map"):
        build_drafter(Method("suffix", 3, {"vocab_map": "auto"}), Resources(target=target, draft=draft))


def test_sampling_with_the_draft_combination_keeps_the_target_distribution(
    enumerable, tmp_path_factory, monkeypatch
) -> None:
    """The draft model's sampled chain (with its q) where suffix has no match: the target's distribution, and a rule
    that accepts every drafted token is caught."""
    import torch

    import verispec.step
    from verispec.drafters.draft_model import DraftModel

    target, joint, _ = enumerable
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    draft = load_model(random_checkpoint(tmp_path_factory.mktemp("suffix") / "draft", config, seed=4))
    drafter = SuffixDecoding(
        2, options=SuffixOptions(history_tokens=0), fallback=DraftModel(draft, 2), fallback_below=50
    )
    assert start_session(drafter, target, PROMPT, SamplingParams(1.0)).propose(PROMPT, 2).q is not None
    counts, drafted = sampled_pairs(target, drafter, PROMPT, DRAWS)
    pvalue, tv = compare(counts.ravel(), joint.ravel())
    assert pvalue > P_VALUE_MIN and tv < (joint.size / DRAWS) ** 0.5 and drafted > 0, (pvalue, tv)

    def accept_all(tokens, q, logits, sampling, generator):  # broken: the draft's samples kept whatever p says
        n = len(tokens)
        return n, int(torch.multinomial(torch.softmax(logits[0, n].float(), -1), 1, generator=generator))

    monkeypatch.setattr(verispec.step, "verify", accept_all)
    counts, _ = sampled_pairs(target, drafter, PROMPT, BROKEN_DRAWS)
    assert compare(counts.ravel(), joint.ravel())[0] < 1e-6


def test_cli_suffix_with_a_draft_below_its_matches(capsys, pair_dirs) -> None:
    target, draft = map(str, pair_dirs)
    args = ["generate", "abcabcabc", "--target", target, "--draft", draft, "--method", "suffix", "--draft-below", "3"]
    assert main([*args, "--max-new-tokens", "16", "--ignore-eos", "--compare"]) == 0
    assert "identical to autoregressive: yes" in capsys.readouterr().out
    assert main(["generate", "x", "--target", target, "--draft", draft, "--method", "suffix"]) == 2
    assert "--draft-below" in capsys.readouterr().err
