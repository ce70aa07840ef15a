"""EAGLE: the head's drafting through the loop (greedy identity, the target's distribution under sampling), its
cache kept to the committed positions, saving and loading, and the training plumbing on a tiny target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from drafting import start_session
from verispec import IncompatibleTargetError, generate
from verispec.checkpoints.draft_vocab import load_draft_vocab, save_draft_vocab
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.drafters.base import Verdict
from verispec.drafters.eagle import Eagle
from verispec.drafters.registry import Method, Resources, build_drafter
from verispec.errors import CheckpointError
from verispec.heads.eagle import EagleHead, PackedEagleHead, head_config, load_head, save_head
from verispec.models.native import load_model
from verispec.sampling import SamplingParams
from verispec.train.eagle import agreement_evaluator, eagle_loss
from verispec.train.loop import TrainConfig, init_weights, train

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]
N = 30

pytestmark = pytest.mark.usefixtures("single_thread")


def random_head(target, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(head_config(target.config))
    init_weights(head)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def head(target) -> EagleHead:
    return random_head(target)


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("tree", [None, (2, 6), (3, 12)])
def test_greedy_identity(target, head, k, tree) -> None:
    truth = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens
    assert generate(target, PROMPT, Eagle(head, k, tree=tree), max_new_tokens=N, ignore_eos=True).tokens == truth


def test_the_dynamic_tree_keeps_the_most_probable_nodes(target, head) -> None:
    """EAGLE-2's tree: `tokens` nodes, parents before children, at most top_k children per node; the head's cache
    holds the expanded frontiers while the tree is out, and only the committed entries after the verdict."""
    session = start_session(Eagle(head, 3, tree=(2, 5)), target, PROMPT)
    proposal = session.propose(PROMPT, 3)
    parents = proposal.parents
    assert len(proposal.tokens) == 5 and all(p < i for i, p in enumerate(parents))
    assert max(sum(1 for p in parents if p == node) for node in range(-1, 5)) <= 2
    assert session.cache.length == len(PROMPT) - 1 + 2 + 2  # two expansions of two nodes each, cut at the verdict
    session.accepted(Verdict([], None, torch.zeros(1, 1, target.hidden_size)))
    assert session.cache.length == len(PROMPT) - 1


def test_a_one_token_prompt_and_a_reduced_vocabulary(target, head) -> None:
    truth = generate(target, PROMPT[:1], max_new_tokens=N, ignore_eos=True).tokens
    assert generate(target, PROMPT[:1], Eagle(head, 3), max_new_tokens=N, ignore_eos=True).tokens == truth
    subset = torch.arange(0, 257, 2)  # the even ids only: odd tokens are never proposed
    result = generate(target, PROMPT, Eagle(head, 3, subset), max_new_tokens=N, ignore_eos=True)
    assert result.tokens == generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens
    assert all(t % 2 == 0 for t, drafted in zip(result.tokens, result.drafted) if drafted)


def test_the_head_drafts_from_its_own_features_and_keeps_only_true_entries(target, head) -> None:
    """The first draft is the head's prediction from the prompt's features; after a verdict the head's cache holds
    the committed positions but the last, built from the target's true features only."""
    session = start_session(Eagle(head, 3), target, PROMPT)
    proposal = session.propose(PROMPT, 3)
    _, hidden = target(torch.tensor([PROMPT]), target.new_cache(), hidden=[-1])
    with torch.inference_mode():
        predicted = head(hidden[:, :-1, 0], target.embed(torch.tensor([PROMPT[1:]])), None)
        first = int(torch.nn.functional.linear(predicted[0, -1], target.lm_head_weight)[:257].argmax())
    assert proposal.tokens[0] == first and session.cache.length == len(PROMPT) - 1 + 2
    session.accepted(Verdict([0], None, torch.zeros(2, 1, target.hidden_size)))
    assert session.cache.length == len(PROMPT) - 1 and session.features.shape == (2, target.hidden_size)


def test_sampling_is_reproducible_and_q_is_the_heads_distribution(target, head) -> None:
    sampling = SamplingParams(1.0, top_k=20)
    proposal = start_session(Eagle(head, 3), target, PROMPT, sampling, torch.Generator().manual_seed(0)).propose(
        PROMPT, 3
    )
    assert proposal.q.shape == (3, target.vocab_size) and int((proposal.q[0] > 0).sum()) == 20
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(3))

    def run(seed: int) -> list[int]:
        return generate(
            target, PROMPT, Eagle(head, 3), max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True
        ).tokens

    assert run(3) == run(3) and len({tuple(run(s)) for s in range(4)}) > 1


E2E_VOCAB, E2E_PROMPT, DRAWS = 6, [1, 4, 2], 2500


@pytest.mark.parametrize("tree", [None, (3, 3)])
def test_sampling_through_generate_follows_the_target(tmp_path, reference_probs, tree) -> None:
    """Two tokens generated with EAGLE drafting the first (one token, or three fixed candidates verified by
    SpecInfer's rule) are distributed as under the target (exact, from the numpy reference)."""
    from test_verify import compare  # chi-square and TV against exact probabilities

    config = tiny_config(vocab_size=E2E_VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    target_dir = random_checkpoint(tmp_path / "target", config, seed=1)
    target = load_model(target_dir, dtype="float32")
    contexts = np.array([E2E_PROMPT + [x] for x in range(E2E_VOCAB)])
    p = reference_probs(target_dir, contexts, 1.0)
    joint = p[0, -2][:, None] * p[:, -1]
    drafter, counts, accepted = Eagle(random_head(target, seed=3), 2, tree=tree), np.zeros((E2E_VOCAB, E2E_VOCAB)), 0
    for seed in range(DRAWS):
        out = generate(target, E2E_PROMPT, drafter, max_new_tokens=2, temperature=1.0, seed=seed, ignore_eos=True)
        counts[out.tokens[0], out.tokens[1]] += 1
        accepted += out.drafted[0]
    pvalue, tv = compare(counts.ravel(), joint.ravel())
    assert pvalue > 1e-3 and tv < (joint.size / DRAWS) ** 0.5, (pvalue, tv)
    assert 0 < accepted < DRAWS  # drafts were both kept and rejected


def test_save_and_load_round_trip(tmp_path, target, head) -> None:
    folder = save_head(head, tmp_path / "head", "tiny", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == target.hidden_size
    loaded = load_head(folder, target.config, torch.float32, fast=False)  # the same kernels as `head`
    drafts = [generate(target, PROMPT, Eagle(h, 4), max_new_tokens=N, ignore_eos=True) for h in (head, loaded)]
    assert drafts[0].tokens == drafts[1].tokens and drafts[0].drafted == drafts[1].drafted
    via_registry = build_drafter(Method("eagle", 4), Resources(target=target, head_dir=folder))
    assert generate(target, PROMPT, via_registry, max_new_tokens=N, ignore_eos=True).drafted == drafts[0].drafted


def test_the_packed_head_drafts_exactly_as_the_plain_one_in_bfloat16(tmp_path, pair_dirs, head) -> None:
    """`load_head` prepacks the head's matmuls (and the drafter its LM head) where it can: on oneDNN's kernels in
    bfloat16 with the same bits as eager F.linear; on verispec's (this CPU at one thread), captured, with its fc as
    two matmuls, close to them but not bitwise. On this random head the drafts are the same tokens either way."""
    target = load_model(pair_dirs[0], dtype=torch.bfloat16)
    folder = save_head(head, tmp_path / "head", "tiny")
    packed, plain = (
        load_head(folder, target.config, torch.bfloat16),
        load_head(folder, target.config, torch.bfloat16, fast=False),
    )
    assert isinstance(packed, PackedEagleHead) and not isinstance(plain, PackedEagleHead)  # what load_head made
    for tree in (None, (2, 6)):
        proposals = [start_session(Eagle(h, 4, tree=tree), target, PROMPT).propose(PROMPT, 4) for h in (packed, plain)]
        assert proposals[0].tokens == proposals[1].tokens and proposals[0].parents == proposals[1].parents


def test_a_reduced_draft_vocabulary_from_saved_frequencies(tmp_path, target, head) -> None:
    folder = save_head(head, tmp_path / "head", "tiny", dtype=torch.float32)
    counts = torch.zeros(257, dtype=torch.long)
    counts[PROMPT] = torch.arange(len(PROMPT), 0, -1)  # ten tokens occur, the prompt's first most often
    save_draft_vocab(folder, counts)
    assert load_draft_vocab(folder, 3).tolist() == PROMPT[:3] and len(load_draft_vocab(folder, 99)) == 9
    drafter = build_drafter(Method("eagle", 3, {"draft_vocab": 5}), Resources(target=target, head_dir=folder))
    result = generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
    assert result.tokens == generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens
    assert {t for t, drafted in zip(result.tokens, result.drafted) if drafted} <= set(PROMPT[:5])
    with pytest.raises(CheckpointError, match="no token frequencies"):
        load_draft_vocab(tmp_path, 5)


def test_a_head_folder_chooses_its_default_draft_vocabulary(tmp_path, target, head) -> None:
    """config.json's verispec.draft_vocab is the default; draft_vocab=0 asks for the full vocabulary."""
    folder = save_head(head, tmp_path / "head", "tiny", dtype=torch.float32)
    save_draft_vocab(folder, torch.arange(257, 0, -1))
    resources = Resources(target=target, head_dir=folder)
    assert build_drafter(Method("eagle", 3), resources).vocab is None  # the folder does not say: full
    config = json.loads((folder / "config.json").read_text())
    config["verispec"]["draft_vocab"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    assert build_drafter(Method("eagle", 3), resources).vocab.tolist() == list(range(7))
    assert build_drafter(Method("eagle", 3, {"draft_vocab": 0}), resources).vocab is None
    assert len(build_drafter(Method("eagle", 3, {"draft_vocab": 9}), resources).vocab) == 9
    for bad in (-5, "2048", 2048.0, True):
        config["verispec"]["draft_vocab"] = bad
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match="verispec.draft_vocab"):
            build_drafter(Method("eagle", 3), resources)


def test_heads_for_other_targets_are_refused(tmp_path, target, unrelated) -> None:
    wide = load_model(random_checkpoint(tmp_path / "wide", tiny_config(hidden_size=96, num_attention_heads=4)))
    folder = save_head(random_head(wide), tmp_path / "head", "wide")
    with pytest.raises(CheckpointError, match="not made for this target"):
        load_head(folder, target.config, torch.float32)
    with pytest.raises(IncompatibleTargetError, match="features of 96"):
        generate(target, PROMPT, Eagle(random_head(wide), 2), max_new_tokens=4)
    with pytest.raises(CheckpointError, match="not an EAGLE head"):
        load_head(tmp_path, target.config, torch.float32)
    broken = random_head(target)
    broken.fc.weight.data[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="fc.weight holds NaN"):
        load_head(save_head(broken, tmp_path / "nan", "tiny"), target.config, torch.float32)


def test_training_lowers_the_loss_and_resumes(tmp_path, target) -> None:
    frozen = target.module.eval().requires_grad_(False)
    tokens = np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16)
    head = random_head(target).train().requires_grad_(True)
    cfg = TrainConfig(hours=8 / 3600, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_every_minutes=4 / 60)
    loss, evaluate = eagle_loss(frozen), agreement_evaluator(frozen, tokens, 32, windows=4)
    batch = torch.from_numpy(tokens[: 4 * 33].astype(np.int64)).view(4, 33)
    with torch.no_grad():
        before = float(loss(head, batch))
    first = train(head, cfg, tmp_path, tokens, loss, evaluate)
    with torch.no_grad():
        assert float(loss(head, batch)) < before and (tmp_path / "state.pt").is_file()
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert {"val_top1_depth1", "val_top1_depth2"} <= log[-1].keys()
    again = train(random_head(target).train().requires_grad_(True), cfg, tmp_path, tokens, loss, evaluate)
    assert again["step"] == first["step"]  # the budget was spent: resumed, nothing more to do


def test_cli_eagle_chain_and_tree_match_autoregressive(capsys, tmp_path, pair_dirs, target, head) -> None:
    from verispec.cli import main

    folder = save_head(head, tmp_path / "head", "tiny", dtype=torch.float32)
    for tree in ([], ["--tree-top-k", "2", "--tree-tokens", "6"]):
        code = main(
            [
                "generate",
                "def f(x):",
                "--target",
                str(pair_dirs[0]),
                "--method",
                "eagle",
                "--head",
                str(folder),
                *tree,
                "--max-new-tokens",
                "16",
                "--ignore-eos",
                "--compare",
                "--threads",
                "1",
            ]
        )
        out, err = capsys.readouterr()
        assert code == 0 and err == "" and "identical to autoregressive: yes" in out
    code = main(["generate", "x", "--target", str(pair_dirs[0]), "--method", "eagle"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("verispec: error: ") and "--head DIR" in err and err.count("\n") == 1
    code = main(
        [
            "generate",
            "x",
            "--target",
            str(pair_dirs[0]),
            "--method",
            "eagle",
            "--head",
            str(folder),
            "--tree-top-k",
            "2",
        ]
    )
    assert code == 2 and "tree_tokens" in capsys.readouterr().err
