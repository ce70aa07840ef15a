"""Tokenizers: loading `tokenizer.json` and the end-of-text id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from verispec.errors import CheckpointError

EOT = "<|endoftext|>"
EOS_NAMES = (EOT, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


def byte_level_tokenizer(size: int = 257) -> Tokenizer:
    """A byte-level BPE tokenizer with 256 byte tokens and `<|endoftext|>`: enough for tests and random models.

    A smaller `size` keeps the first `size` tokens only: a toy vocabulary for a model with a table that small.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet[:size])}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if size > len(alphabet):
        tok.add_special_tokens([EOT])
    return tok


def save_tokenizer(tokenizer: Tokenizer, folder: str | Path, context_length: int = 512) -> None:
    """tokenizer.json, plus the small tokenizer_config.json that lets transformers' AutoTokenizer load it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    eot = EOT if tokenizer.token_to_id(EOT) is not None else None
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eot,
        "bos_token": eot,
        "unk_token": eot,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir}: no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust library raises a bare Exception on malformed files
        raise CheckpointError(f"{path}: unreadable tokenizer ({err})") from None


def as_id_set(value: int | Sequence[int] | None) -> frozenset[int]:
    """An `eos_token_id` as configs write it (one id, a list, or nothing) as a set."""
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)


def eos_token_ids(
    tokenizer: Tokenizer, checkpoint_dir: str | Path, config_eos: int | Sequence[int] | None
) -> frozenset[int]:
    """End-of-sequence ids: config.json's and generation_config.json's (instruct models list several), else a
    conventional special token."""
    ids = as_id_set(config_eos)
    gen = Path(checkpoint_dir) / "generation_config.json"
    if gen.is_file():
        try:
            ids |= as_id_set(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError, TypeError) as err:
            raise CheckpointError(f"{gen}: unreadable ({err})") from None
    return ids or conventional_eos(tokenizer)


def conventional_eos(tokenizer: Tokenizer) -> frozenset[int]:
    """For a checkpoint that names no end-of-sequence id: the first conventional end-of-text token it has."""
    return as_id_set(next((tid for name in EOS_NAMES if (tid := tokenizer.token_to_id(name)) is not None), None))


def check_tokenizer_fits(tokens: int, rows: int, name: str | Path) -> None:
    """The model scores `rows` tokens; a tokenizer with more could never have the extra ones generated.

    A table padded larger than the tokenizer is common and fine: the loop scores only the tokenizer's ids.
    """
    if tokens > rows:
        raise CheckpointError(
            f"{name}: the tokenizer has {tokens} tokens but the model's embedding table only "
            f"{rows} rows; ids {rows} and up could never be generated"
        )


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters any one token stands for: a vocabulary entry's length bounds its text (byte-level entries
    spell one character per byte, and a character is at least a byte), so a text longer than `n` times this cannot
    fit in `n` tokens."""
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
