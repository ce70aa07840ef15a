"""Incremental detokenization: the text of each new token, held back while it may be part of a stop string."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizers import Tokenizer

from verispec.stops import StopMatcher

PREFIX_TOKENS = 4  # prompt tokens decoded in front of the output, so decoders that strip a leading space don't


@dataclass(frozen=True)
class Piece:
    text: str
    drafted: bool  # True when the token was a drafter's proposal that the target accepted


class TextTracker:
    """Keeps one `Piece` per generated token; their texts join to the output text."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, StopMatcher(stop)
        # Each token's text is decode(window + token) minus decode(window), over a short window of the tokens
        # before it (vLLM's incremental detokenization): O(1) per token, and correct for decoders whose output
        # depends on neighbours (a stripped leading space, a character split across byte tokens).
        self._all = list(prompt[-PREFIX_TOKENS:])
        self._window_start, self._read = 0, len(self._all)
        self.ids: list[int] = []
        self.text = ""  # decoded text of `ids`, minus an incomplete UTF-8 tail
        self.pieces: list[Piece] = []
        self.emitted, self._emitted_chars = 0, 0  # pieces (and their characters) already handed out
        self.stopped = False

    def add(self, ids: Sequence[int], drafted: Sequence[bool]) -> int:
        """Append tokens; returns how many were kept: all, or up to the one that completed a stop string."""
        for count, (token, from_draft) in enumerate(zip(ids, drafted), start=1):
            self.ids.append(token)
            new = self._next_text(token)
            self.text += new
            self.pieces.append(Piece(new, from_draft))
            found = self.stop.feed(new)
            if found is not None:
                self._cut(found)
                return count
        return len(ids)

    def _next_text(self, token: int) -> str:
        self._all.append(token)
        window = self._all[self._window_start :]
        before = self.tokenizer.decode(window[: self._read - self._window_start], skip_special_tokens=True)
        after = self.tokenizer.decode(window, skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):  # mid-character, or nothing printable yet
            return ""
        self._window_start, self._read = self._read, len(self._all)
        return after[len(before) :]

    def _cut(self, at: int) -> None:
        """End the text where the stop string starts; every token up to the one that completed it stays."""
        self.stopped, start = True, 0
        for i, piece in enumerate(self.pieces):
            self.pieces[i] = Piece(piece.text[: max(0, at - start)], piece.drafted)
            start += len(piece.text)
        self.text = self.text[:at]

    def ready(self, final: bool = False) -> list[Piece]:
        """Pieces not yet handed out: all of them when final, else those that cannot start a stop string."""
        held = 0 if final else self.stop.held
        boundary, start = len(self.text) - held, self.emitted
        while self.emitted < len(self.pieces) and self._emitted_chars + len(self.pieces[self.emitted].text) <= boundary:
            self._emitted_chars += len(self.pieces[self.emitted].text)
            self.emitted += 1
        return self.pieces[start : self.emitted]
