"""Stop strings found in text that arrives a piece at a time, in time linear in the text.

One Knuth-Morris-Pratt automaton per stop string: its state is the longest prefix of the string that the text ends
with, so a piece costs O(its length) per string however long the strings are, and the text a stream must hold back
(it may be the start of a stop string) is the largest state.
"""

from __future__ import annotations

from typing import Sequence


def _failure(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Feed it the text piece by piece; it says where the first stop string starts once one is complete."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._length = 0  # characters fed so far

    @property
    def held(self) -> int:
        """How many characters at the end of the text may be the start of a stop string."""
        return max(self._state, default=0)

    def feed(self, piece: str) -> int | None:
        """Advance over the next piece of text; returns the offset in the whole text at which a stop string that ends
        in this piece starts (the earliest such start over every string), or None."""
        found = None
        for j, (s, fail) in enumerate(zip(self.stops, self._fail)):
            k = self._state[j]
            for i, ch in enumerate(piece):
                while k and ch != s[k]:
                    k = fail[k - 1]
                if ch == s[k]:
                    k += 1
                if k == len(s):  # this string's first occurrence; a later one can only start later
                    start = self._length + i + 1 - len(s)
                    found = start if found is None else min(found, start)
                    k = fail[k - 1]
                    break
            self._state[j] = k
        self._length += len(piece)
        return found
