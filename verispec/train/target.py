"""Pre-training the default target model on the standard library's train split."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.folder import save_checkpoint
from verispec.checkpoints.tokenizer import EOT, save_tokenizer
from verispec.models.llama import LlamaForCausalLM
from verispec.train.corpus import load_split
from verispec.train.loop import TrainConfig, even_windows, init_weights, train
from verispec.train.tokenizer import train_tokenizer

# 26.7M parameters (4.2M of them the tied embedding), 512 positions.
TARGET_CONFIG = ModelConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=7,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)


def tokenized_split(run_dir: Path, tokenizer: Tokenizer, split: str) -> np.ndarray:
    """All files of a split, each followed by the end-of-text token, as uint16 ids (cached in run_dir, keyed by
    the tokenizer so that a retrained one never reads stale ids)."""
    key = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:12]
    cache = run_dir / f"{split}-{key}.npy"
    if cache.exists():
        return np.load(cache)
    texts, skipped = load_split(split)
    if skipped:
        print(f"{split}: {skipped} files missing or changed since the manifest were skipped")
    eot = tokenizer.token_to_id(EOT)
    ids = [i for enc in tokenizer.encode_batch(texts) for i in (*enc.ids, eot)]
    array = np.asarray(ids, dtype=np.uint16)
    np.save(cache, array)
    return array


def prepare(run_dir: Path, vocab_size: int) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    run_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = run_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        save_tokenizer(train_tokenizer(load_split("train")[0], vocab_size), tok_dir)
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return tokenizer, tokenized_split(run_dir, tokenizer, "train"), tokenized_split(run_dir, tokenizer, "validation")


def lm_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits, _ = model(batch[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def evaluator(tokens: np.ndarray, tokenizer: Tokenizer, seq_len: int, windows: int = 16):
    """Validation loss (nats/token) and bits per byte on fixed, evenly spaced windows."""
    batch = even_windows(tokens, windows, seq_len)
    num_bytes = sum(len(tokenizer.decode(row[1:].tolist(), skip_special_tokens=False).encode()) for row in batch)

    @torch.no_grad()
    def evaluate(model: LlamaForCausalLM) -> dict:
        losses = [float(lm_loss(model, batch[i : i + 4])) for i in range(0, windows, 4)]
        loss = sum(losses) / len(losses)
        return {"val_loss": loss, "val_bpb": loss * batch[:, 1:].numel() / (num_bytes * math.log(2))}

    return evaluate


def export(model: LlamaForCausalLM, tokenizer_dir: Path, folder: Path) -> Path:
    """A Hugging Face folder in bf16, the format verispec and transformers both load."""
    weights = {
        k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return save_checkpoint(folder, model.config, weights, tokenizer, torch.bfloat16)


def train_target(run_dir: Path, cfg: TrainConfig, config: ModelConfig = TARGET_CONFIG) -> Path:
    tokenizer, train_tokens, val_tokens = prepare(run_dir, config.vocab_size)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    init_weights(model)
    print(
        f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(train_tokens) / 1e6:.2f}M train tokens, {len(val_tokens) / 1e6:.2f}M validation tokens",
        flush=True,
    )
    train(model, cfg, run_dir, train_tokens, lm_loss, evaluator(val_tokens, tokenizer, cfg.seq_len))
    return export(model, run_dir / "tokenizer", run_dir / "model")
