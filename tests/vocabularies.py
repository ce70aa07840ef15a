"""Tokenizers and checkpoints of other vocabularies, for the tests of a draft with another tokenizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from verispec.checkpoints.config import read_config
from verispec.checkpoints.folder import save_checkpoint
from verispec.checkpoints.tokenizer import EOT


def byte_bpe(tokens: list[str], merges: list[tuple[str, str]], special: tuple[str, ...] = (EOT,)) -> Tokenizer:
    """A byte-level BPE with these vocabulary entries (in id order), merges and special tokens after them."""
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special))
    return tok


# The twin's merges: "de", "def" and two spaces, tokens the target (one token a byte) does not have.
TWIN_MERGES = [("d", "e"), ("de", "f"), ("Ġ", "Ġ")]


def twin_checkpoint(draft_dir: Path, folder: Path) -> Path:
    """The draft of conftest's pair (`draft_dir`) with another tokenizer: the 256 bytes in reverse id order, three
    merges after them, then <|endoftext|>; its embedding rows moved with their bytes (so it agrees with the target as
    the draft does where it reads single bytes) and small random rows for the merged tokens. A short context (48), so
    that long generations move its window."""
    config, weights = read_config(draft_dir), load_file(str(draft_dir / "model.safetensors"))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[::-1]  # the conftest target's byte tokens, reversed
    merged = ["".join(pair) for pair in TWIN_MERGES]
    tokenizer = byte_bpe(alphabet + merged, TWIN_MERGES)
    V = 256 + len(merged) + 1
    order = torch.tensor([255 - i for i in range(256)])
    generator = torch.Generator().manual_seed(3)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            old = weights[name]
            small = 0.1 * torch.randn(len(merged), old.shape[1], generator=generator)  # (rarely its argmax)
            weights[name] = torch.cat((old[order], small, old[256:257]))
    config = replace(config, vocab_size=V, eos_token_id=V - 1, max_position_embeddings=48)
    return save_checkpoint(folder, config, weights, tokenizer)
