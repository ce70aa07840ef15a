"""Distilling the draft model from the target: KL(p_target || q_draft) on the train split."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from verispec.checkpoints.draft_vocab import save_draft_vocab
from verispec.models.llama import LlamaForCausalLM
from verispec.models.native import load_model
from verispec.train.loop import TrainConfig, even_windows, init_weights, train
from verispec.train.target import TARGET_CONFIG, export, tokenized_split

# Small enough that one of its decoding steps costs well under 1/8 of the target's, the budget (its card,
# models/stdlib-draft/README.md, has the measured cost).
DRAFT_VOCAB = 2048  # the most frequent tokens it drafts among by default (models/stdlib-draft/README.md)
DRAFT_CONFIG = replace(
    TARGET_CONFIG,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=3,
)


def kl_loss(teacher: LlamaForCausalLM):
    """Mean over positions of KL(p || q), p the target's next-token distribution and q the draft's."""

    def loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            log_p = F.log_softmax(teacher(batch[:, :-1])[0].float(), -1)
        log_q = F.log_softmax(model(batch[:, :-1])[0].float(), -1)
        return F.kl_div(log_q.flatten(0, 1), log_p.flatten(0, 1), log_target=True, reduction="batchmean")

    return loss


def agreement_evaluator(teacher: LlamaForCausalLM, tokens: np.ndarray, seq_len: int, windows: int = 16):
    """Validation KL and top-1 agreement of the draft with the target, on fixed windows."""
    batch = even_windows(tokens, windows, seq_len)
    with torch.no_grad():
        teacher_logits = torch.cat([teacher(batch[i : i + 4, :-1])[0] for i in range(0, windows, 4)])

    @torch.no_grad()
    def evaluate(model: LlamaForCausalLM) -> dict:
        logits = torch.cat([model(batch[i : i + 4, :-1])[0] for i in range(0, windows, 4)])
        kl = F.kl_div(
            F.log_softmax(logits, -1).flatten(0, 1),
            F.log_softmax(teacher_logits, -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
        agree = (logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean()
        return {"val_kl": float(kl), "val_top1_agreement": float(agree)}

    return evaluate


def train_draft(run_dir: Path, target_dir: Path, cfg: TrainConfig, config=DRAFT_CONFIG) -> Path:
    """Distil a draft from the exported target in `target_dir` (its tokenizer, its data split)."""
    target = load_model(target_dir)
    teacher = target.module.eval().requires_grad_(False)
    run_dir.mkdir(parents=True, exist_ok=True)
    train_tokens = tokenized_split(run_dir, target.tokenizer, "train")
    val_tokens = tokenized_split(run_dir, target.tokenizer, "validation")
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(replace(config, vocab_size=target.config.vocab_size))
    init_weights(model)
    print(f"draft: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    train(model, cfg, run_dir, train_tokens, kl_loss(teacher), agreement_evaluator(teacher, val_tokens, cfg.seq_len))
    folder = export(model, target_dir, run_dir / "model")
    # The train split's token frequencies beside it, and the draft vocabulary it drafts over by default
    save_draft_vocab(folder, torch.from_numpy(np.bincount(train_tokens, minlength=target.config.vocab_size)))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(config | {"verispec": {"draft_vocab": DRAFT_VOCAB}}, indent=2) + "\n"
    )
    return folder
