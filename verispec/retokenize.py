"""Text re-encoded between two tokenizers: bytes to a tokenizer's ids, and the draft's ids for the text the target has
committed so far, kept up to date as it grows."""

from __future__ import annotations

import re
from typing import Sequence

from tokenizers import Tokenizer

from verispec.vocab_map import TokenTable

# Bytes that are not UTF-8 become lone surrogates under "surrogateescape"; they are encoded as single-byte tokens.
_NOT_UTF8 = re.compile("([\udc80-\udcff])")
LOOKBEHIND = 8  # draft tokens re-encoded again with each new piece of text: new text can re-merge the last few


class Encoder:
    """A tokenizer and its token table: ids to bytes and bytes to ids."""

    def __init__(self, tokenizer: Tokenizer, table: TokenTable) -> None:
        self.tokenizer, self.table = tokenizer, table

    def bytes_of(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.table.pieces[i] or b"" for i in ids)

    def encode(self, data: bytes) -> list[int]:
        """`data` as this tokenizer encodes it (no special tokens added); a byte that is not part of a UTF-8
        character (a character cut by a token boundary) as its single-byte token, or U+FFFD where there is none."""
        ids: list[int] = []
        for part in _NOT_UTF8.split(data.decode("utf-8", "surrogateescape")):
            if len(part) == 1 and "\udc80" <= part <= "\udcff":
                single = self.table.singles.get(ord(part) - 0xDC00)
                ids += [single] if single is not None else self._text("\ufffd")
            elif part:
                ids += self._text(part)
        return ids

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


class DraftText:
    """The draft's tokens for the target's committed text, re-encoded as it grows: each `update` appends the new
    target tokens' bytes and re-encodes from `LOOKBEHIND` draft tokens back, where the new text may merge with the
    old. Where the draft's tokens do not give the text back byte for byte (a normalizer), the whole text is encoded
    each time instead. What the draft is given never changes what the target outputs, only how often it agrees."""

    def __init__(self, target: TokenTable, draft: Encoder) -> None:
        self.target, self.draft = target, draft
        self.ids: list[int] = []
        self._ends: list[int] = []  # the byte offset where each of `ids` ends
        self._bytes = bytearray()
        self._seen = 0  # target tokens whose bytes are in _bytes
        self._exact = True

    def update(self, context: Sequence[int]) -> int:
        """Bring `ids` up to `context` (every committed target token: the last one's context and more). Returns how
        many leading `ids` are as before."""
        self._bytes += b"".join(self.target.pieces[t] or b"" for t in context[self._seen :])
        self._seen = len(context)
        keep = max(0, len(self.ids) - LOOKBEHIND) if self._exact else 0
        start = self._ends[keep - 1] if keep else 0
        tail = self.draft.encode(bytes(self._bytes[start:]))
        if self.draft.bytes_of(tail) != self._bytes[start:]:
            self._exact, keep, start = False, 0, 0
            tail = self.draft.encode(bytes(self._bytes))
        ends, end = [], start
        for i in tail:
            end += len(self.draft.table.pieces[i] or b"")
            ends.append(end)
        self.ids, self._ends = self.ids[:keep] + tail, self._ends[:keep] + ends
        return keep
