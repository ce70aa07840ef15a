"""Medusa: the tree from measured accuracy, drafting through the loop (greedy identity, the target's distribution
under sampling), saving and loading in the reference layout, and the training plumbing on a tiny target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from drafting import start_session
from verispec import generate
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.drafters.medusa import Medusa
from verispec.drafters.registry import Method, Resources, build_drafter
from verispec.errors import CheckpointError, IncompatibleTargetError
from verispec.heads.medusa import MedusaHeads, best_paths, load_heads, save_heads
from verispec.models.native import load_model
from verispec.train.loop import TrainConfig, train
from verispec.train.medusa import accuracy_evaluator, medusa_loss

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]
N = 30

pytestmark = pytest.mark.usefixtures("single_thread")


def random_heads(target, heads: int = 3, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    module = MedusaHeads.from_target(target.lm_head_weight.detach(), heads)
    with torch.no_grad():  # away from the identity start, so that each head guesses differently
        for head in module.medusa_head:
            head[0].linear.weight.normal_(0, 0.3)
    return module.eval()


@pytest.fixture(scope="module")
def heads(target) -> MedusaHeads:
    return random_heads(target)


def test_best_paths_follow_the_products_of_accuracies() -> None:
    accuracy = [[0.6, 0.2], [0.5, 0.1], [0.3, 0.05]]
    # products: (0,) 0.6, (0, 0) 0.3, (1,) 0.2, (1, 0) 0.1, (0, 0, 0) 0.09, (0, 1) 0.06, ...
    assert best_paths(accuracy, 4) == [(0,), (1,), (0, 0), (1, 0)]
    assert best_paths(accuracy, 5)[-1] == (0, 0, 0)
    assert best_paths(accuracy, 100) == sorted(best_paths(accuracy, 100), key=lambda p: (len(p), p))
    assert len(best_paths(accuracy, 100)) == 2 + 4 + 8  # every path, prefixes first


@pytest.mark.parametrize("tokens", [1, 4, 12])
def test_greedy_identity(target, heads, tokens) -> None:
    truth = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens
    drafter = Medusa(heads, tokens=tokens)
    assert generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True).tokens == truth
    assert (
        generate(target, PROMPT[:1], drafter, max_new_tokens=N, ignore_eos=True).tokens
        == generate(target, PROMPT[:1], max_new_tokens=N, ignore_eos=True).tokens
    )


def test_the_tree_reads_each_heads_ranked_guesses(target, heads) -> None:
    drafter = Medusa(heads, [[0.6, 0.3], [0.5, 0.1], [0.4, 0.1]], tokens=5)
    proposal = start_session(drafter, target, PROMPT).propose(PROMPT, 3)
    _, hidden = target(torch.tensor([PROMPT[:-1]]), target.new_cache(), hidden=[-1])
    with torch.inference_mode():
        ranked = heads(hidden[0, -1, 0])[:, :257].topk(2, -1).indices
    paths = drafter.paths
    assert paths == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]  # products .6, .3, .3, .15, .12
    expected = [int(ranked[len(p) - 1, p[-1]]) for p in paths]
    assert proposal.tokens == expected and proposal.parents == [-1, -1, 0, 1, 2]
    assert start_session(drafter, target, PROMPT).propose(PROMPT, 1).tokens == expected[:2]  # cut to depth k


def test_sampling_through_generate_follows_the_target(tmp_path, reference_probs) -> None:
    from test_verify import compare

    config = tiny_config(vocab_size=6, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    target_dir = random_checkpoint(tmp_path / "target", config, seed=1)
    target, prompt = load_model(target_dir, dtype="float32"), [1, 4, 2]
    p = reference_probs(target_dir, np.array([prompt + [x] for x in range(6)]), 1.0)
    joint, draws = p[0, -2][:, None] * p[:, -1], 2500
    drafter, counts, accepted = Medusa(random_heads(target, 2, seed=3), tokens=3), np.zeros((6, 6)), 0
    for seed in range(draws):
        out = generate(target, prompt, drafter, max_new_tokens=2, temperature=1.0, seed=seed, ignore_eos=True)
        counts[out.tokens[0], out.tokens[1]] += 1
        accepted += out.drafted[0]
    pvalue, tv = compare(counts.ravel(), joint.ravel())
    assert pvalue > 1e-3 and tv < (joint.size / draws) ** 0.5, (pvalue, tv)
    assert 0 < accepted < draws


def test_save_and_load_in_the_reference_layout(tmp_path, target, heads) -> None:
    accuracy = [[0.5, 0.2], [0.4, 0.1], [0.3, 0.1]]
    folder = save_heads(heads, tmp_path / "medusa", "tiny", accuracy, dtype=torch.float32)
    from safetensors.torch import load_file

    keys = set(load_file(str(folder / "model.safetensors")))
    assert keys == {
        f"medusa_head.{i}.{part}" for i in range(3) for part in ("0.linear.weight", "0.linear.bias", "1.weight")
    }
    assert json.loads((folder / "config.json").read_text())["medusa_num_heads"] == 3
    loaded, saved_accuracy = load_heads(folder, target.hidden_size, 257, torch.float32)
    assert saved_accuracy == accuracy
    runs = [
        generate(target, PROMPT, Medusa(h, accuracy, 6), max_new_tokens=N, ignore_eos=True) for h in (heads, loaded)
    ]
    assert runs[0].drafted == runs[1].drafted
    via_registry = build_drafter(Method("medusa", None, {"tree_tokens": 6}), Resources(target=target, head_dir=folder))
    assert generate(target, PROMPT, via_registry, max_new_tokens=N, ignore_eos=True).drafted == runs[0].drafted
    with pytest.raises(CheckpointError, match="not made for this target"):
        load_heads(folder, 96, 257, torch.float32)
    with pytest.raises(IncompatibleTargetError, match="features of 64"):
        wide = load_model(random_checkpoint(tmp_path / "wide", tiny_config(hidden_size=96, num_attention_heads=4)))
        generate(wide, PROMPT, Medusa(heads), max_new_tokens=4)


def test_training_lowers_the_loss_and_logs_accuracy(tmp_path, target) -> None:
    frozen = target.module.eval().requires_grad_(False)
    tokens = np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16)
    heads = random_heads(target, 2).train().requires_grad_(True)
    cfg = TrainConfig(hours=6 / 3600, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_every_minutes=3 / 60)
    loss, evaluate = medusa_loss(frozen), accuracy_evaluator(frozen, tokens, 32, windows=4)
    batch = torch.from_numpy(tokens[: 4 * 33].astype(np.int64)).view(4, 33)
    with torch.no_grad():
        before = float(loss(heads, batch))
    train(heads, cfg, tmp_path, tokens, loss, evaluate)
    with torch.no_grad():
        assert float(loss(heads, batch)) < before
    log = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])
    assert len(log["accuracy"]) == 2 and all(len(row) == 4 for row in log["accuracy"])
