"""Incremental detokenization: the text of each new token, held back while it may be part of a stop string."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizers import Tokenizer


@dataclass(frozen=True)
class Piece:
    text: str
    drafted: bool  # True when the token was a drafter's proposal that the target accepted


class TextTracker:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # decoded text of `ids`, minus an incomplete UTF-8 tail
        self.pieces: list[Piece] = []  # one per token
        self.emitted = 0  # pieces already handed out
        self._emitted_chars = 0
        self.stopped = False

    def add(self, ids: Sequence[int], drafted: Sequence[bool]) -> None:
        """Append tokens; on reaching a stop string, keep only the text before it and the tokens that made it."""
        for token, from_draft in zip(ids, drafted):
            self.ids.append(token)
            full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            # A byte-level token may end mid-character: hold its text until the character completes.
            new = "" if full.endswith("\ufffd") else full[len(self.text):]
            self.text += new
            self.pieces.append(Piece(new, from_draft))
            hit = [i for s in self.stop if (i := self.text.find(s, max(0, len(self.text) - len(new) - len(s) + 1))) >= 0]
            if hit:
                self._cut(min(hit))
                return

    def _cut(self, at: int) -> None:
        self.stopped = True
        kept, length = [], 0
        for piece in self.pieces:
            if length >= at:
                break
            kept.append(Piece(piece.text[: at - length], piece.drafted))
            length += len(piece.text)
        self.pieces, self.text, self.ids = kept, self.text[:at], self.ids[: len(kept)]

    def ready(self, final: bool = False) -> list[Piece]:
        """Pieces not yet handed out: all of them when final, else those that cannot start a stop string."""
        held = 0 if final else max((n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        boundary, start = len(self.text) - held, self.emitted
        while self.emitted < len(self.pieces) and self._emitted_chars + len(self.pieces[self.emitted].text) <= boundary:
            self._emitted_chars += len(self.pieces[self.emitted].text)
            self.emitted += 1
        return self.pieces[start:self.emitted]
