"""The text a drafting head for a real target trains on: a weighted mixture of the target's own answers
(distill.py), prose and dialogue (prose.py) and the standard library's code (corpus.py), tokenized by the target's
tokenizer and cached in the run's folder (`data-*.npy`), with validation text from each source's held-out split.

The mixture is one token array in which each source fills its share (repeated where it is short), so that the
loop's uniformly drawn windows come from each source in that proportion. The draft vocabulary is the mixture's most
frequent tokens, so it covers what the target itself says.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from verispec.train.corpus import load_split, split_of
from verispec.train.prose import prose_split

SHARES = {"distill": 0.6, "prose": 0.2, "stdlib": 0.2}  # of the training windows
MIXTURE_TOKENS = 20_000_000  # the mixture's length: more than a CPU run reads, so its windows rarely repeat
SEPARATOR = "<|endoftext|>"  # between documents, where the tokenizer has it (else its end-of-sequence token)


def separator(tokenizer: Tokenizer, eos: int) -> int:
    found = tokenizer.token_to_id(SEPARATOR)
    return eos if found is None else found


def conversations(folder: Path, split: str) -> list[list[int]]:
    """The token ids of the stored self-distilled conversations of one split (by a hash of their key)."""
    out = []
    for file in sorted(folder.glob("answers-*.jsonl")):
        for line in file.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if split_of(f"distill/{record['key']}") == split:
                out.append(record["ids"])
    return out


def source_documents(
    name: str, split: str, run_dir: Path, tokenizer: Tokenizer, distill_dir: Path, data_dir: Path
) -> list[list[int]]:
    """One source's documents of one split, as token ids."""
    if name == "distill":
        return conversations(distill_dir, split)
    texts = [text for _, text in prose_split(data_dir, split)] if name == "prose" else load_split(split)[0]
    return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]


def source_tokens(
    name: str, split: str, run_dir: Path, tokenizer: Tokenizer, sep: int, distill_dir: Path, data_dir: Path
) -> np.ndarray:
    """One source's split as one array, documents each followed by `sep`; cached by the tokenizer and, for the
    distilled answers, by how many there are (a run started while they are written reads a fixed set)."""
    docs = source_documents(name, split, run_dir, tokenizer, distill_dir, data_dir) if name == "distill" else None
    key = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:12] + (f"-{len(docs)}" if docs is not None else "")
    cache = run_dir / f"data-{name}-{split}-{key}.npy"
    if cache.exists():
        return np.load(cache)
    if docs is None:
        docs = source_documents(name, split, run_dir, tokenizer, distill_dir, data_dir)
    array = np.asarray([i for doc in docs for i in (*doc, sep)], dtype=np.uint32)
    np.save(cache, array)
    return array


def mixture(parts: dict[str, np.ndarray], shares: dict[str, float], total: int) -> np.ndarray:
    """One array in which each non-empty part fills its share of `total` tokens, repeated or cut to length."""
    present = {name: part for name, part in parts.items() if len(part)}
    weight = sum(shares[name] for name in present)
    pieces = []
    for name, part in present.items():
        want = int(total * shares[name] / weight)
        pieces.append(np.tile(part, -(-want // len(part)))[:want])
    return np.concatenate(pieces)


def head_corpus(
    run_dir: Path,
    tokenizer: Tokenizer,
    eos: int,
    distill_dir: Path,
    data_dir: Path,
    shares: dict[str, float] = SHARES,
    total: int = MIXTURE_TOKENS,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The training mixture and the validation tokens (every source's validation split, in the same shares), and a
    summary of the sources' sizes in tokens."""
    run_dir.mkdir(parents=True, exist_ok=True)
    sep = separator(tokenizer, eos)
    splits = {
        split: {name: source_tokens(name, split, run_dir, tokenizer, sep, distill_dir, data_dir) for name in shares}
        for split in ("train", "validation")
    }
    sizes = {split: {name: len(part) for name, part in parts.items()} for split, parts in splits.items()}
    val_total = sum(sizes["validation"].values())
    return mixture(splits["train"], shares, total), mixture(splits["validation"], shares, val_total), sizes


def frequent_tokens(tokens: np.ndarray, vocab_size: int, count: int) -> torch.Tensor:
    """The `count` most frequent token ids of `tokens`, most frequent first (ties by id)."""
    counts = torch.from_numpy(np.bincount(tokens, minlength=vocab_size)[:vocab_size].astype(np.int64))
    return torch.argsort(counts, descending=True, stable=True)[:count]
