"""A reduced draft vocabulary (as in FR-Spec and EAGLE-3): the training split's tokens, most frequent first, saved
in a drafting head's folder. A head that drafts over a prefix of it pays for a fraction of the LM head; the target
still scores every token, so verification stays exact.

The file lives in the folder's `verispec/` subfolder, never at its top level: vLLM's and SGLang's loaders read every
top-level `*.safetensors` of a folder without an index as weights, and would fail on it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from verispec.errors import CheckpointError

EXTRAS = "verispec"  # the subfolder of a head's folder for what only verispec reads
VOCAB_FILE = f"{EXTRAS}/draft_vocab.safetensors"
OLD_VOCAB_FILE = "draft_vocab.safetensors"  # where folders written before the move keep it


def vocab_file(folder: str | Path) -> Path:
    """The draft vocabulary's file in a head's folder: `verispec/`, else the top level of an older folder."""
    old = Path(folder) / OLD_VOCAB_FILE
    return old if old.is_file() and not (Path(folder) / VOCAB_FILE).is_file() else Path(folder) / VOCAB_FILE


def save_draft_vocab(folder: str | Path, token_counts: torch.Tensor) -> Path:
    """The token ids that occur in the training data, most frequent first: a reduced draft vocabulary is a prefix."""
    order = torch.argsort(token_counts, descending=True, stable=True)
    ids = order[: int((token_counts > 0).sum())].to(torch.int32).contiguous()
    file = Path(folder) / VOCAB_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({"ids": ids}, str(file))
    return file


def load_draft_vocab(folder: str | Path, size: int) -> torch.Tensor:
    """The `size` most frequent token ids saved beside a head (for a draft LM head over them only); all of them
    where fewer than `size` tokens occur in its training data."""
    file = vocab_file(folder)
    if not file.is_file():
        raise CheckpointError(
            f"{file}: no token frequencies beside this head, so no reduced draft vocabulary "
            f"(draft_vocab {size}; 0 drafts over the full vocabulary)"
        )
    return load_file(str(file))["ids"].to(torch.long)[:size]


def head_section(folder: str | Path) -> dict:
    """The `verispec` section of a head folder's config.json (what only verispec reads); empty where there is none."""
    config = Path(folder) / "config.json"
    try:
        section = json.loads(config.read_text()).get("verispec", {}) if config.is_file() else {}
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{config}: unreadable ({err})") from None
    return section if isinstance(section, dict) else {}


def default_size(folder: str | Path) -> int:
    """The draft vocabulary size a head's folder chooses: `verispec.draft_vocab` in its config.json, set where its
    card measured that drafting over fewer tokens pays; 0 (the full vocabulary) when it does not say."""
    config = Path(folder) / "config.json"
    size = head_section(folder).get("draft_vocab", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CheckpointError(f"{config}: verispec.draft_vocab must be a whole number of tokens (0: all), got {size!r}")
    return size


def head_draft_vocab(folder: str | Path, size: int | None) -> torch.Tensor | None:
    """The draft vocabulary a head drafts over: its `size` most frequent tokens, 0 for the full vocabulary (None),
    and by default (`size` None) the size its folder chooses (`default_size`)."""
    size = default_size(folder) if size is None else size
    return None if not size else load_draft_vocab(folder, size)


def spread(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits (..., N) over the tokens `ids` (N,) as logits over the whole vocabulary (..., vocab_size), -inf at
    every other token: a drafter over a reduced vocabulary never proposes the others, and under sampling its q is
    zero there."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., ids] = logits
    return full
