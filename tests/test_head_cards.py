"""The drafting heads' model cards state the numbers they measure (on a tiny target with random heads)."""

from __future__ import annotations

import json

import pytest
import torch

from verispec.checkpoints.draft_vocab import save_draft_vocab
from verispec.heads.eagle import EagleHead, head_config, save_head
from verispec.heads.medusa import MedusaHeads, save_heads
from verispec.train.head_cards import write_eagle_card, write_medusa_card
from verispec.train.loop import init_weights

pytestmark = pytest.mark.usefixtures("single_thread")


def _with_frequencies(folder, target):
    counts = torch.arange(target.config.vocab_size, 0, -1)  # token 0 most frequent, and so on
    save_draft_vocab(folder, counts)
    return folder


def test_eagle_card(tmp_path, target) -> None:
    torch.manual_seed(0)
    head = EagleHead(head_config(target.config))
    init_weights(head)
    folder = _with_frequencies(save_head(head, tmp_path / "head", "tiny", dtype=torch.float32), target)
    (tmp_path / "log.jsonl").write_text(
        json.dumps({"tokens_seen": 10**6, "hours": 0.5, "val_top1_depth1": 0.61, "val_top1_depth2": 0.52})
    )
    numbers = write_eagle_card(target, folder, tmp_path, num_prompts=2)
    card = (folder / "README.md").read_text()
    assert numbers["chain"]["identical_to_autoregressive"] == numbers["tree"]["identical_to_autoregressive"] == 1.0
    assert f"tau {numbers['chain']['tau']:.2f}" in card and f"tau {numbers['tree']['tau']:.2f}" in card
    assert "61.0% at depth 1" in card and f"{numbers['draft_cost_ratio']:.3f} of a target decoding step" in card


def test_medusa_card(tmp_path, target) -> None:
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target.lm_head_weight.detach(), 3)
    accuracy = [[0.6, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.1, 0.1, 0.05]]
    folder = _with_frequencies(save_heads(heads, tmp_path / "heads", "tiny", accuracy, torch.float32), target)
    (tmp_path / "log.jsonl").write_text(
        json.dumps({"tokens_seen": 2 * 10**6, "hours": 0.25, "val_top1_by_head": [0.6, 0.4, 0.3], "accuracy": accuracy})
    )
    numbers = write_medusa_card(target, folder, tmp_path, num_prompts=2)
    card = (folder / "README.md").read_text()
    for tree in ("tree", "reduced_vocab_tree"):
        assert numbers[tree]["identical_to_autoregressive"] == 1.0 and f"tau {numbers[tree]['tau']:.2f}" in card
    assert "by head: 60.0%, 40.0%, 30.0%" in card and "3 heads" in card
    assert f"costs {numbers['draft_cost_ratio']:.3f} of a target decoding step" in card
