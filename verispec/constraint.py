"""One generation's grammar state: the tokens the grammar allows after the committed output and after any drafted
prefix, a proposal checked against it before verification, and its matcher kept in step with the target's cache.

The matcher (llguidance's) walks forward along a drafted prefix and rolls back by n tokens; a `Constraint` moves it
wherever it is asked (a draft chain, any node of a token tree) and remembers the mask at every prefix until the next
commit, so that the drafter's masks and the verification's are computed once. After each verdict `commit` moves it to
the accepted tokens and the target's own: the tokens the cache dropped, the matcher rolls back.
"""

from __future__ import annotations

from typing import Sequence

import llguidance
import numpy as np
import torch

from verispec.errors import DrafterError, GrammarError
from verispec.proposal import Proposal
from verispec.sampling import constrain
from verispec.tree import chain_parents, subset, through_eos

STUCK = (
    "the grammar allows none of this model's tokens after the output so far: it cannot be completed in this vocabulary"
)


class Constraint:
    """The grammar after the committed output. `allowed(prefix)`, `constrain(logits, prefix)` for drafters, `check`
    for the step, `commit` after it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: frozenset[int]) -> None:
        self._matcher, self.vocab_size, self.eos = matcher, vocab_size, eos
        self._at: list[int] = []  # what the matcher has consumed past the committed output
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # prefix past the committed output -> allowed (V,)
        # After an end-of-sequence token the output is over. The matcher never consumes one: llguidance does not count
        # it among the tokens it rolls back. The row after it is never verified on, but must still be a distribution.
        self._ended = False
        self._after_eos = torch.zeros(vocab_size, dtype=torch.bool)
        self._after_eos[sorted(eos)] = True

    def allowed(self, prefix: Sequence[int] = ()) -> torch.Tensor:
        """(V,) bool, on the CPU: the tokens the grammar allows after the committed output and `prefix` (every token
        of which the grammar must allow in turn)."""
        key = tuple(prefix)
        if self._ended or (key and key[-1] in self.eos):
            return self._after_eos
        mask = self._masks.get(key)
        if mask is None:
            self._seek(key)
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool))
            self._raise_if_error()
            self._masks[key] = mask
        return mask

    def constrain(self, logits: torch.Tensor, prefix: Sequence[int] = ()) -> torch.Tensor | None:
        """A drafter's logits (..., V) at the position after `prefix`, with the tokens the grammar forbids there at
        -inf: q gets the mask p gets, as speculative sampling needs to stay exact. None where no token is left (a
        reduced draft vocabulary may hold none of the allowed ones): the proposal ends before that position."""
        masked = constrain(logits, self.allowed(prefix).to(logits.device))
        return masked if bool((masked > -torch.inf).any()) else None

    def check(self, proposal: Proposal) -> tuple[Proposal, list[int], torch.Tensor]:
        """`proposal` less every token the grammar forbids and all that follows it (a chain ends there, a tree loses
        that subtree), before it costs a row of the target's forward; also less a token after which the grammar allows
        nothing (a vocabulary in which it cannot go on). Returns that proposal, the original index of each token kept,
        and the allowed tokens (1 + kept, V) at the root and at each kept token: the rows of p the mask applies to.

        A drafter that sampled must have drawn from a q with the grammar's mask (`constrain`): one that gives a
        forbidden token mass is refused, since speculative sampling with it would not keep the constrained p."""
        root = self.allowed()
        if not root.any():
            raise GrammarError(STUCK)
        parents = chain_parents(len(proposal.tokens)) if proposal.parents is None else proposal.parents
        prefixes: dict[int, tuple[int, ...]] = {-1: ()}  # kept token -> the tokens from the root to it
        keep = []
        for i, (token, parent) in enumerate(zip(proposal.tokens, parents)):
            if parent in prefixes and self.allowed(prefixes[parent])[token]:
                prefix = (*prefixes[parent], token)
                if self.allowed(prefix).any():
                    prefixes[i] = prefix
                    keep.append(i)
        if proposal.q is not None and keep:
            self._check_q(proposal.q[keep], torch.stack([self.allowed(prefixes[parents[i]]) for i in keep]))
        allowed = torch.stack([root, *(self.allowed(prefixes[i]) for i in keep)])
        return subset(proposal, keep), keep, allowed

    @staticmethod
    def _check_q(q: torch.Tensor, allowed: torch.Tensor) -> None:
        """q (n, V) of drafted tokens, drawn where the grammar allowed `allowed` (n, V): none of its mass elsewhere."""
        if bool((q.masked_fill(allowed.to(q.device), 0) > 0).any()):
            raise DrafterError(
                "the drafter sampled from a q that gives tokens the grammar forbids some mass; "
                "speculative sampling stays exact only with the grammar's mask on q as on p "
                "(Constraint.constrain)"
            )

    def commit(self, tokens: Sequence[int]) -> None:
        """`tokens` join the committed output: the matcher rolls back from wherever drafting left it to the prefix it
        shares with them, and consumes the rest (up to an end-of-sequence token, which ends the output)."""
        tokens = list(tokens)
        end = through_eos(tokens, self.eos)  # what follows an end-of-sequence token is never committed
        ended = end > 0 and tokens[end - 1] in self.eos
        self._seek(tuple(tokens[: end - ended]))
        self._ended |= ended
        self._at, self._masks = [], {}

    def _seek(self, prefix: tuple[int, ...]) -> None:
        """Move the matcher to the committed output and `prefix`."""
        common = 0
        for have, want in zip(self._at, prefix):
            if have != want:
                break
            common += 1
        if common < len(self._at):
            self._matcher.rollback(len(self._at) - common)
            del self._at[common:]
        rest = list(prefix[common:])
        consumed = self._matcher.try_consume_tokens(rest) if rest else 0  # (a refused token leaves it as it was)
        self._at += rest[:consumed]
        self._raise_if_error()
        if consumed < len(rest):
            raise GrammarError(
                f"the grammar does not allow token {rest[consumed]} after the output so far and "
                f"{list(prefix[: common + consumed])}"
            )

    def _raise_if_error(self) -> None:
        if not self._matcher.is_error():
            return
        reason = self._matcher.get_error().splitlines()[0]  # (then a dump of the parser's state)
        raise GrammarError(STUCK if reason.startswith("NoExtension") else f"the grammar failed: {reason}")
