"""Training an EAGLE head on a frozen target: its features are computed on the fly, so nothing is stored on disk.

For a window x_0..x_L, the target gives features f_0..f_{L-1} (final-normed) and logits at each position. The head
reads (f_i, embedding of x_{i+1}) and predicts f_{i+1}: the loss is EAGLE's, a smooth-L1 regression on the feature
plus 0.1 times the cross-entropy of the target's next-token distribution against the head's logits (through the
target's LM head). Input features get small uniform noise, as in EAGLE, so that the head tolerates its own errors
when it drafts from its predictions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from verispec.heads.eagle import EagleHead, head_config, save_head
from verispec.models.llama import LlamaForCausalLM
from verispec.train.features import frozen_target, save_frequencies, target_view
from verispec.train.loop import TrainConfig, even_windows, init_weights, train

FEATURE_WEIGHT, TOKEN_WEIGHT, NOISE = 1.0, 0.1, 0.1


def head_outputs(
    head: EagleHead, target: LlamaForCausalLM, batch: torch.Tensor, features: torch.Tensor, noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's predicted features f^_1..f^_{L-1} and their logits, from (f_i, x_{i+1}) for i < L - 1."""
    inputs = features[:, :-1]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    with torch.no_grad():
        embeddings = target.model.embed_tokens(batch[:, 1:-1])
    predicted = head(inputs, embeddings, None)
    return predicted, target.lm_head(predicted)


def eagle_loss(target: LlamaForCausalLM):
    def loss(head: EagleHead, batch: torch.Tensor) -> torch.Tensor:
        features, logits = target_view(target, batch)
        predicted, head_logits = head_outputs(head, target, batch, features, NOISE)
        regression = F.smooth_l1_loss(predicted.float(), features[:, 1:])
        p = F.softmax(logits[:, 1:], -1)
        token = -(p * F.log_softmax(head_logits.float(), -1)).sum(-1).mean()
        return FEATURE_WEIGHT * regression + TOKEN_WEIGHT * token

    return loss


def agreement_evaluator(target: LlamaForCausalLM, tokens: np.ndarray, seq_len: int, windows: int = 16):
    """Top-1 agreement with the target at draft depth 1 (from the target's own features) and depth 2 (from the
    head's predicted features, fed back once), on fixed validation windows."""
    batch = even_windows(tokens, windows, seq_len)

    @torch.no_grad()
    def evaluate(head: EagleHead) -> dict:
        agree = {1: [], 2: []}
        for i in range(0, windows, 4):
            rows = batch[i : i + 4]
            features, logits = target_view(target, rows)
            choice = logits.argmax(-1)  # the target's next token after each position
            predicted, first = head_outputs(head, target, rows, features)
            agree[1].append((first.argmax(-1) == choice[:, 1:]).float().mean())
            # depth 2: the predicted f^_{i+1} with the embedding of x_{i+2} predicts f_{i+2}
            again = head(predicted[:, :-1], target.model.embed_tokens(rows[:, 2:-1]), None)
            agree[2].append((target.lm_head(again).argmax(-1) == choice[:, 2:]).float().mean())
        return {f"val_top1_depth{d}": float(torch.stack(v).mean()) for d, v in agree.items()}

    return evaluate


def train_eagle(run_dir: Path, target_dir: Path, cfg: TrainConfig) -> Path:
    """Train a head for the exported target in `target_dir` on the corpus's train split."""
    target, frozen, train_tokens, val_tokens = frozen_target(run_dir, target_dir, cfg)
    head = EagleHead(head_config(target.config))
    init_weights(head)
    print(f"eagle head: {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters", flush=True)
    train(head, cfg, run_dir, train_tokens, eagle_loss(frozen), agreement_evaluator(frozen, val_tokens, cfg.seq_len))
    return save_frequencies(save_head(head, run_dir / "model", target_dir.name), train_tokens, target)
