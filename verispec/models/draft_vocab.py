"""A reduced draft vocabulary (as in FR-Spec and EAGLE-3): the training split's tokens, most frequent first, saved
beside a drafting head. A head that drafts over a prefix of it pays for a fraction of the LM head; the target still
scores every token, so verification stays exact."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from verispec.errors import CheckpointError


VOCAB_FILE = "draft_vocab.safetensors"


def save_draft_vocab(folder: str | Path, token_counts: torch.Tensor) -> Path:
    """The token ids that occur in the training data, most frequent first: a reduced draft vocabulary is a prefix."""
    order = torch.argsort(token_counts, descending=True, stable=True)
    ids = order[: int((token_counts > 0).sum())].to(torch.int32).contiguous()
    save_file({"ids": ids}, str(Path(folder) / VOCAB_FILE))
    return Path(folder) / VOCAB_FILE


def load_draft_vocab(folder: str | Path, size: int) -> torch.Tensor:
    """The `size` most frequent token ids saved beside a head (for a draft LM head over them only)."""
    file = Path(folder) / VOCAB_FILE
    if not file.is_file():
        raise CheckpointError(f"{file}: no token frequencies beside this head, so no reduced draft vocabulary")
    ids = load_file(str(file))["ids"].to(torch.long)
    return ids[:size]


def head_draft_vocab(folder: str | Path, size: int | None) -> torch.Tensor | None:
    """The draft vocabulary a head drafts over: its `size` most frequent tokens; 0 for the full vocabulary (None);
    and by default (`size` None) the head's own choice, `verispec.draft_vocab` in its config.json, which a head's
    folder sets where its card measured that drafting over fewer tokens pays (full when it does not say)."""
    if size is None:
        config = Path(folder) / "config.json"
        size = json.loads(config.read_text()).get("verispec", {}).get("draft_vocab") if config.is_file() else None
    return None if not size else load_draft_vocab(folder, size)
