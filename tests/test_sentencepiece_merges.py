"""The merges a SentencePiece GGUF's tokenizer is built with (gguf_tokenizer.merges_by_score), found by hashing every
cut of every token, against the definition they follow (transformers' `generate_merges` order), written plainly."""

from __future__ import annotations

import random

import pytest

from gguf_files import spm_vocab
from verispec.checkpoints import gguf_tokenizer
from verispec.checkpoints.gguf_tokenizer import merges_by_score


def defined(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scoring result first, then the longer left part, then the longer
    right one; among equals in token order, a token's own splits by the ids of their parts."""
    vocab = {token: i for i, token in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        found += [(a, b, score) for a, b in sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def random_vocab(seed: int) -> tuple[list[str], list[float]]:
    """Short strings over a few letters, a visible space and characters outside the basic plane, with few distinct
    scores (ties everywhere), built up from pieces so that many split into others."""
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "\u2581", "é", "\U0001f600", "<", ">"]
    tokens = list(dict.fromkeys(alphabet))
    while len(tokens) < 600:
        token = rng.choice(tokens) + rng.choice(tokens)
        if token not in tokens and len(token) <= 12:
            tokens.append(token)
    rng.shuffle(tokens)
    return tokens, [float(rng.randint(-5, 0)) for _ in tokens]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_merges_are_the_defined_ones_in_the_defined_order(seed) -> None:
    tokens, scores = random_vocab(seed)
    assert merges_by_score(tokens, scores) == defined(tokens, scores)
    tokens, _, scores = spm_vocab(("<start_of_turn>", "<end_of_turn>"))
    assert merges_by_score(tokens, scores) == defined(tokens, scores)


def test_where_the_tokens_hashes_collide_the_cuts_are_looked_up_one_by_one(monkeypatch) -> None:
    """A multiplier of 1 sums the characters: "ab" and "ba" collide, so no hash is trusted, and every cut is looked up
    in a dictionary instead; the merges are the same."""
    tokens, scores = random_vocab(3)
    tokens = tokens + [t for t in ("ab", "ba") if t not in tokens]
    scores = scores + [0.0] * (len(tokens) - len(scores))
    hashed, original = [], gguf_tokenizer._matches

    def matches(*args):
        hashed.append(original(*args))
        return hashed[-1]

    monkeypatch.setattr(gguf_tokenizer, "HASH_MULTIPLIERS", (1,))
    monkeypatch.setattr(gguf_tokenizer, "_matches", matches)
    assert merges_by_score(tokens, scores) == defined(tokens, scores)
    assert hashed == [None]
