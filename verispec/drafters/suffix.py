"""SuffixDecoding (Oliaro et al., NeurIPS 2025; ArcticInference, vLLM's `suffix`): propose what most often followed
the text's suffix, in this generation's own text and in earlier generations.

Two suffix trees (`suffix_tree.py`): one per generation, over its prompt and the tokens it commits, and one shared
by every generation of the drafter (`SharedHistory`: the generated tokens of this process's or server's generations,
the live ones included, bounded in tokens). Each step, every suffix of the text that occurs in a tree is a match; the
continuations of a match of n tokens grow best first by their empirical probability (their counts over the match's),
at most `spec_factor` x n of them and none below `min_prob`, into a chain or, with `tree_tokens`, a tree; the best
score (the sum of the proposed tokens' probabilities) over all matches of both trees is proposed. The candidates are
fixed, not sampled, so under sampling they go with one-hot q, and the tree rule for such candidates (SpecInfer's,
draws without replacement from p) keeps the target's distribution.

What the shared tree holds depends on the generations before and beside this one, so a seeded sampled generation is
reproducible only with the same history (`history_tokens=0` turns it off); a greedy one is the target's own whatever
the history. With `eagle_below` (SAM-Decoding's combination, Hu et al. 2024) an EAGLE head drafts the steps whose
best match is shorter than that many tokens; with `draft_below`, the draft model does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from verispec.argument_checks import real_number, whole_number
from verispec.drafters.base import DraftContext, Drafter, DraftSession, Needs, Proposal, Verdict
from verispec.drafters.batch import SequenceStart
from verispec.drafters.options import SUFFIX_K, SuffixOptions
from verispec.drafters.suffix_tree import NOTHING, Candidate, Limits, SuffixTree, TreeSequence
from verispec.errors import InvalidArgumentError
from verispec.models.protocol import CausalLM


@dataclass
class Recorded:
    """Where a generation's tokens go in the shared history: its sequence in one of the trees (none yet: None)."""

    tree: SuffixTree | None = None
    sequence: TreeSequence | None = None


class SharedHistory:
    """The generated tokens of a drafter's generations in two suffix trees, for every session of the drafter and its
    batched engine, from any thread (one lock). New tokens go to the young tree; once it holds half of `budget`, the
    old tree is dropped whole and the young one takes its place, so at most `budget` tokens are held and the latest
    half of them always are. A generation that is still running then goes on as a new sequence of the new young tree."""

    def __init__(self, budget: int, depth: int) -> None:
        self.budget, self.depth = budget, depth
        self._lock = threading.Lock()
        self._young, self._old = SuffixTree(depth), None

    def record(self, recorded: Recorded, tokens: Sequence[int]) -> None:
        """Add a generation's new tokens (`recorded`: where its earlier ones went, updated here)."""
        if not tokens:
            return
        with self._lock:
            if recorded.tree is not self._young:
                recorded.tree, recorded.sequence = self._young, self._young.sequence()
            self._young.extend(recorded.sequence, tokens)
            if 2 * self._young.tokens >= self.budget:
                self._old, self._young = self._young, SuffixTree(self.depth)

    @property
    def tokens(self) -> int:
        with self._lock:
            return self._young.tokens + (0 if self._old is None else self._old.tokens)

    def speculate(self, pattern: Sequence[int], limits: Limits) -> Candidate:
        with self._lock:
            return _best(tree.speculate(pattern, limits) for tree in (self._young, self._old) if tree is not None)


def _best(candidates) -> Candidate:
    """The highest score; the first among equals."""
    best = NOTHING
    for candidate in candidates:
        if candidate.score > best.score:
            best = candidate
    return best


class SuffixDecoding:
    """Proposes from suffix trees (see the module's notes): a chain of at most k tokens, or with `tree_tokens` a tree
    of at most that many nodes, k deep. Unlike other drafters it keeps state across generations: the shared history.

    `fallback`: a drafter (EAGLE's head, or a draft model) that drafts instead where the best match is shorter than
    `fallback_below` tokens; it sees every verdict, so its own state follows the text."""

    name = "suffix"

    def __init__(
        self,
        k: int = SUFFIX_K,
        tree_tokens: int | None = None,
        options: SuffixOptions | None = None,
        fallback: Drafter | None = None,
        fallback_below: int = 0,
    ) -> None:
        self.k = whole_number(k, "k (tokens drafted per step)", 1)
        self.tree = tree_tokens is not None
        nodes = self.k if tree_tokens is None else whole_number(tree_tokens, "tree_tokens", 1)
        options = options or SuffixOptions()
        depth = whole_number(options.suffix_depth, "suffix_depth", 2)
        factor = real_number(options.spec_factor, "spec_factor")
        min_prob = real_number(options.min_prob, "min_prob")
        if not factor > 0 or not 0 <= min_prob <= 1:
            raise InvalidArgumentError(
                f"suffix needs spec_factor > 0 and 0 <= min_prob <= 1, got {factor} and {min_prob}"
            )
        self.limits = Limits(nodes, self.k, factor, min_prob, self.tree)
        self.depth = depth
        budget = whole_number(options.history_tokens, "history_tokens", 0)
        self.history = SharedHistory(budget, depth) if budget else None
        self.fallback, self.fallback_below = fallback, whole_number(fallback_below, "eagle_below or draft_below", 0)
        self.width = nodes if fallback is None else max(nodes, fallback.width)
        extra = Needs() if fallback is None else fallback.needs
        self.needs = Needs(tree_masks=self.tree or extra.tree_masks, hidden_states=extra.hidden_states)
        self.batched = fallback is None  # the fallback's state is one sequence's
        self.scores = fallback is None  # every proposal carries its tokens' estimated chances (the fallback's do not)

    def check(self, target: CausalLM) -> None:
        if self.fallback is not None:
            self.fallback.check(target)

    def begin(self, context: DraftContext) -> SuffixSession:
        fallback = None if self.fallback is None else self.fallback.begin(context)
        return SuffixSession(self, context.prompt, fallback)

    def begin_batch(self, target: CausalLM, slots: int) -> SuffixBatch:
        """Suffix decoding for the batched engine: a tree per sequence, the history shared. The engine verifies
        chains: a tree-shaped drafter proposes the chain of its likeliest continuation there."""
        return SuffixBatch(self)


class SuffixSession:
    """One generation: its own tree over the prompt and what it commits, its sequence in the shared history."""

    def __init__(
        self,
        drafter: SuffixDecoding,
        prompt: Sequence[int],
        fallback: DraftSession | None = None,
        tree: bool | None = None,
    ) -> None:
        self.drafter, self.fallback = drafter, fallback
        self.limits = drafter.limits if tree is None else replace(drafter.limits, tree=tree)
        self.local = SuffixTree(drafter.depth)
        self.text: TreeSequence = self.local.sequence()
        self.local.extend(self.text, prompt)
        self.shared = None if drafter.history is None else Recorded()

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        new = context[len(self.text.tokens) :]
        self.local.extend(self.text, new)
        if self.shared is not None:
            self.drafter.history.record(self.shared, new)
        best = NOTHING
        if k >= 1:
            nodes = self.limits.nodes if self.limits.tree else min(self.limits.nodes, k)  # a chain: k at most
            limits = replace(self.limits, depth=min(k, self.limits.depth), nodes=nodes)
            history = self.drafter.history
            best = _best(
                [
                    self.local.speculate_own(self.text, limits),  # (its text is the context)
                    NOTHING if history is None else history.speculate(context, limits),
                ]
            )
        if self.fallback is not None:
            suffix_proposes = bool(best.tokens) and best.match >= self.drafter.fallback_below
            # k 0 where the suffix trees propose: the fallback drafts nothing but follows the text
            proposal = self.fallback.propose(context, 0 if suffix_proposes else k)
            if not suffix_proposes:
                return proposal
        return Proposal(best.tokens, None, best.parents if self.limits.tree else None, confidence=best.probs)

    def accepted(self, verdict: Verdict) -> None:
        """Nothing of its own to roll back (the trees hold committed tokens only); the fallback's, if any."""
        if self.fallback is not None:
            self.fallback.accepted(verdict)


class SuffixBatch:
    """Suffix decoding for a batch: a `SuffixSession` (chains) per slot, the drafter's history shared. It runs no
    model, so there is no forward to batch."""

    def __init__(self, drafter: SuffixDecoding) -> None:
        self.drafter, self.sessions = drafter, {}

    def add(self, slot: int, start: SequenceStart) -> None:
        self.sessions[slot] = SuffixSession(self.drafter, start.prompt, tree=False)

    def propose(self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int]) -> dict[int, Proposal]:
        return {slot: self.sessions[slot].propose(contexts[slot], k) for slot, k in ks.items()}

    def accepted(self, verdicts: Mapping[int, Verdict]) -> None:
        """Nothing to roll back: the trees hold committed tokens only."""

    def rollback(self, slot: int, committed: int) -> None:
        """Nothing to roll back: the trees hold committed tokens only."""

    def remove(self, slot: int) -> None:
        del self.sessions[slot]
