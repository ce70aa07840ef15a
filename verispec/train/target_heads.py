"""A drafting head for a real target (a GGUF file, or a folder other than the shipped target): its prompts answered by
itself (`distill_answers`), then an EAGLE-3 head trained on the mixture of head_data.py (`train_target_head`).

The target trains in bfloat16 (or float32 with `TrainConfig.bf16` off), dequantized from a GGUF file's blocks,
since verispec's block kernels compute no gradients and its features are only read; the answers come from the
target as it runs for users (`dtype="auto"`, a GGUF file's own formats, exact mode), so they are what it says.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from verispec.checkpoints.chat_template import load_chat_template
from verispec.checkpoints.fingerprint import gguf_fingerprint
from verispec.checkpoints.gguf_file import is_gguf
from verispec.errors import InvalidArgumentError
from verispec.models.native import load_model
from verispec.train.distill import distill
from verispec.train.eagle3 import STEPS, train_eagle3
from verispec.train.head_data import frequent_tokens, head_corpus
from verispec.train.loop import TrainConfig
from verispec.train.prompts import Prompt, build_prompts
from verispec.train.prose import paragraphs, prose_split

DRAFT_VOCAB = 2048  # draft tokens of the head's own LM head: the mixture's most frequent
PROMPTS = 2400


def distill_answers(
    runs: Path, target_path: Path, count: int = PROMPTS, shard: int = 0, shards: int = 1, max_new_tokens: int = 320
) -> Path:
    """Answer shard `shard` of `shards` of `count` prompts (RUNS/distill/prompts.jsonl, drawn once) with the target."""
    folder = runs / "distill"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "prompts.jsonl"
    if not file.exists():
        drawn = build_prompts(count, 0, paragraphs(prose_split(runs / "data", "train")))
        file.write_text("".join(json.dumps({"key": p.key, "turns": p.turns}) + "\n" for p in drawn))
    prompts = [Prompt(d["key"], tuple(d["turns"])) for d in map(json.loads, file.read_text().splitlines())][:count]
    target = load_model(target_path, dtype="auto", exact=True)
    template = load_chat_template(target_path, target.tokenizer)
    if template is None:
        raise InvalidArgumentError(f"{target_path} has no chat template to render the prompts with")
    return distill(target, template, prompts, folder, shard, shards, max_new_tokens)


def target_identity(target_path: Path) -> dict | None:
    """What a shipped head records to be found for this target (checkpoints/shipped.py): a GGUF file's fingerprint."""
    return gguf_fingerprint(target_path) if is_gguf(target_path) else None


def train_target_head(
    runs: Path, target_path: Path, cfg: TrainConfig, steps: int = STEPS, draft_vocab: int = DRAFT_VOCAB
) -> Path:
    """Train an EAGLE-3 head for the target in RUNS/eagle3 (resumable); returns its exported folder."""
    run_dir = runs / "eagle3"
    target = load_model(target_path, dtype="bfloat16" if cfg.bf16 else "float32", fast=False)
    module = target.module.eval().requires_grad_(False)
    eos = target.config.eos_token_id if target.config.eos_token_id is not None else min(target.eos_token_ids)
    train_tokens, val_tokens, sizes = head_corpus(run_dir, target.tokenizer, eos, runs / "distill", runs / "data")
    print(f"data (tokens): {json.dumps(sizes)}", flush=True)
    ids_file = run_dir / "draft_ids.npy"  # fixed at the first start: a resumed head keeps its LM head's rows
    if not ids_file.exists():
        np.save(ids_file, frequent_tokens(train_tokens, target.config.vocab_size, draft_vocab).numpy())
    ids = torch.from_numpy(np.load(ids_file))
    extra = {"target_match": target_identity(target_path), "training_tokens": sizes, "training_time_test_steps": steps}
    return train_eagle3(run_dir, module, target.name, train_tokens, val_tokens, ids, cfg, steps, extra)
