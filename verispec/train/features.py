"""What head training (EAGLE, Medusa) shares: the frozen target, its features and logits computed on the fly for
each batch (so nothing is stored on disk), and the training split's token frequencies saved beside the head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from verispec.checkpoints.draft_vocab import save_draft_vocab
from verispec.models.forward_options import ForwardOptions
from verispec.models.llama import LlamaForCausalLM
from verispec.models.native import NativeModel, load_model
from verispec.models.protocol import FINAL
from verispec.train.loop import TrainConfig
from verispec.train.target import tokenized_split


def frozen_target(
    run_dir: Path, target_dir: Path, cfg: TrainConfig
) -> tuple[NativeModel, LlamaForCausalLM, np.ndarray, np.ndarray]:
    """The target (and its module, frozen), its train and validation tokens; the seed set for the head's init."""
    target = load_model(target_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    train_tokens = tokenized_split(run_dir, target.tokenizer, "train")
    val_tokens = tokenized_split(run_dir, target.tokenizer, "validation")
    torch.manual_seed(cfg.seed)
    return target, target.module.eval().requires_grad_(False), train_tokens, val_tokens


def target_view(target: LlamaForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's final-normed features and logits over the windows' inputs, (B, L, D) and (B, L, V)."""
    with torch.no_grad():
        logits, (hidden,) = target(batch[:, :-1], options=ForwardOptions(hidden=[FINAL]))
    return hidden.float(), logits.float()


def save_frequencies(folder: Path, train_tokens: np.ndarray, target: NativeModel) -> Path:
    """The head's folder, with the train split's token frequencies beside it (a reduced draft vocabulary)."""
    save_draft_vocab(folder, torch.from_numpy(np.bincount(train_tokens, minlength=target.config.vocab_size)))
    return folder
