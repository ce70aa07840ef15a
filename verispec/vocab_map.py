"""Two tokenizers side by side: the bytes each token stands for, and the tokens two vocabularies share.

A token's bytes come from its vocabulary entry: a byte-level BPE (GPT-2's, Llama 3's, SmolLM's) spells each byte as
one character of its alphabet; a SentencePiece-style vocabulary writes a space as "▁" and a raw byte as "<0xNN>".
An added token (a chat template's <|im_start|>, an end of text) stands for its content, and a special one is a
control token: it is shared only with a special token of the same content, never with text.

Two vocabularies share a token where both have a token for the same bytes (special with special). The map pairs
each shared string once, one id on each side, so a distribution over the draft's shared tokens is one over the
target's shared tokens too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable

import torch
from tokenizers import Tokenizer

_RAW_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table inverted: the printable Latin-1 bytes stand for themselves, the other 68 bytes
    for the characters 256 and up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF_CHAR = _byte_alphabet()


@dataclass(frozen=True)
class TokenTable:
    """What each token id of a tokenizer stands for."""

    pieces: tuple[bytes | None, ...]  # per id: its bytes; None where the entry cannot be read as bytes
    special: frozenset[int]  # control tokens (added tokens marked special)
    singles: dict[int, int]  # byte value -> a non-special token of exactly that byte (text that is not UTF-8)

    @property
    def size(self) -> int:
        return len(self.pieces)


def _kind(spec: dict) -> str | None:
    """How a tokenizer spells bytes in its vocabulary, from its decoder: "byte_level", "sentencepiece" or None."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {part.get("type") for part in parts}
    if "ByteLevel" in types:
        return "byte_level"
    replaces_meta = any(
        part.get("type") == "Replace" and part.get("pattern", {}).get("String") == "▁" for part in parts
    )
    if types & {"Metaspace", "ByteFallback"} or replaces_meta:
        return "sentencepiece"
    return None


def _piece(entry: str, kind: str) -> bytes | None:
    if kind == "byte_level":
        try:
            return bytes(BYTE_OF_CHAR[ch] for ch in entry)
        except KeyError:  # not spelled in the byte alphabet
            return None
    raw = _RAW_BYTE.fullmatch(entry)
    return bytes([int(raw.group(1), 16)]) if raw else entry.replace("▁", " ").encode("utf-8")


def token_table(tokenizer: Tokenizer) -> TokenTable | None:
    """Each token's bytes; None for a tokenizer whose vocabulary is neither byte-level nor SentencePiece-style
    (WordPiece's "##" pieces, say), whose tokens cannot be joined back into text byte for byte."""
    spec = json.loads(tokenizer.to_str())
    kind = _kind(spec)
    if kind is None:
        return None
    pieces: list[bytes | None] = [None] * tokenizer.get_vocab_size(with_added_tokens=True)
    for entry, i in tokenizer.get_vocab(with_added_tokens=False).items():
        pieces[i] = _piece(entry, kind)
    special = set()
    for added in spec.get("added_tokens", []):
        pieces[added["id"]] = added["content"].encode("utf-8")
        if added.get("special"):
            special.add(added["id"])
    singles: dict[int, int] = {}
    for i, piece in enumerate(pieces):
        if piece is not None and len(piece) == 1 and i not in special:
            singles.setdefault(piece[0], i)
    return TokenTable(tuple(pieces), frozenset(special), singles)


@dataclass(frozen=True)
class VocabMap:
    """The tokens two vocabularies share, paired one to one: draft id `draft_ids[i]` and target id `target_ids[i]`
    stand for the same bytes (draft ids ascending)."""

    draft_ids: torch.Tensor  # (N,) int64
    target_ids: torch.Tensor  # (N,) int64
    target_size: int  # ids the target scores
    draft_size: int

    def __len__(self) -> int:
        return len(self.draft_ids)

    def twins(self) -> dict[int, int]:
        """target id -> its draft twin."""
        return dict(zip(self.target_ids.tolist(), self.draft_ids.tolist()))

    def covered(self, target_tokens: Iterable[int]) -> float:
        """The share of `target_tokens` (a run's output, say) that are shared tokens: what a draft over the
        intersection could have proposed."""
        tokens = list(target_tokens)
        shared = set(self.target_ids.tolist())
        return sum(t in shared for t in tokens) / len(tokens) if tokens else 0.0


def shared_tokens(target: TokenTable, draft: TokenTable, target_size: int, draft_size: int) -> VocabMap:
    """The intersection of two vocabularies, over the ids each model scores (`*_size`: a table padded past its
    tokenizer has ids without tokens). Where a vocabulary has two tokens for the same bytes (a byte-fallback token
    and a character), the lowest id stands for them."""
    by_bytes: dict[tuple[bool, bytes], int] = {}
    for i in range(min(target.size, target_size)):
        piece = target.pieces[i]
        if piece:
            by_bytes.setdefault((i in target.special, piece), i)
    pairs, taken = [], set()
    for i in range(min(draft.size, draft_size)):
        piece = draft.pieces[i]
        t = by_bytes.get((i in draft.special, piece)) if piece else None
        if t is not None and t not in taken:
            taken.add(t)
            pairs.append((i, t))
    ids = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    return VocabMap(ids[:, 0].contiguous(), ids[:, 1].contiguous(), target_size, draft_size)
