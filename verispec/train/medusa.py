"""Training Medusa heads on a frozen target by self-distillation: head i learns the target's own distribution
i + 1 tokens further on (KL to its logits there), from the target's final-normed feature, computed on the fly.

Why the target's distribution and not the corpus's next tokens: a head is only worth what the target accepts, and the
target's choices are what it accepts; soft labels also carry the ranking that the tree's lower ranks use. Head i's
loss is weighted 0.8**i, as in Medusa. The evaluation logs, per head and rank, how often the head's r-th best token is
the target's own choice: that table shapes the drafting tree and is saved with the heads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from verispec.heads.medusa import MedusaHeads, save_heads
from verispec.models.llama import LlamaForCausalLM
from verispec.train.features import frozen_target, save_frequencies, target_view
from verispec.train.loop import TrainConfig, even_windows, train

DECAY, RANKS = 0.8, 4


def medusa_loss(target: LlamaForCausalLM):
    def loss(heads: MedusaHeads, batch: torch.Tensor) -> torch.Tensor:
        features, logits = target_view(target, batch)  # (B, L, D), (B, L, V)
        L, total = features.shape[1], 0.0
        out = heads(features)  # (B, L, heads, V)
        for i in range(heads.num_heads):
            shift = i + 1  # head i at position t predicts what the target predicts at t + i + 1
            if shift >= L:
                break
            log_p = F.log_softmax(logits[:, shift:], -1)
            log_q = F.log_softmax(out[:, : L - shift, i].float(), -1)
            kl = F.kl_div(log_q.flatten(0, 1), log_p.flatten(0, 1), log_target=True, reduction="batchmean")
            total = total + DECAY**i * kl
        return total

    return loss


def accuracy_evaluator(target: LlamaForCausalLM, tokens: np.ndarray, seq_len: int, windows: int = 16):
    """accuracy[i][r]: how often head i's r-th best token is the target's argmax i + 1 positions later."""
    batch = even_windows(tokens, windows, seq_len)

    @torch.no_grad()
    def evaluate(heads: MedusaHeads) -> dict:
        hits, counts = torch.zeros(heads.num_heads, RANKS), torch.zeros(heads.num_heads)
        for start in range(0, windows, 4):
            features, logits = target_view(target, batch[start : start + 4])
            choice, ranked = logits.argmax(-1), heads(features).topk(RANKS, -1).indices  # (B, L), (B, L, heads, R)
            L = choice.shape[1]
            for i in range(heads.num_heads):
                shift = i + 1
                hits[i] += (ranked[:, : L - shift, i] == choice[:, shift:, None]).float().sum((0, 1))
                counts[i] += choice[:, shift:].numel()
        accuracy = (hits / counts[:, None]).tolist()
        return {"val_top1_by_head": [row[0] for row in accuracy], "accuracy": accuracy}

    return evaluate


def train_medusa(run_dir: Path, target_dir: Path, cfg: TrainConfig, num_heads: int = 4) -> Path:
    """Train heads for the exported target in `target_dir` on the corpus's train split; saves them with the last
    evaluation's accuracy table."""
    target, frozen, train_tokens, val_tokens = frozen_target(run_dir, target_dir, cfg)
    heads = MedusaHeads.from_target(frozen.lm_head.weight.detach().float(), num_heads)
    print(f"medusa: {num_heads} heads, {sum(p.numel() for p in heads.parameters()) / 1e6:.1f}M parameters", flush=True)
    evaluate = accuracy_evaluator(frozen, val_tokens, cfg.seq_len)
    train(heads, cfg, run_dir, train_tokens, medusa_loss(frozen), evaluate)
    folder = save_heads(heads, run_dir / "model", target_dir.name, evaluate(heads.eval())["accuracy"])
    return save_frequencies(folder, train_tokens, target)
