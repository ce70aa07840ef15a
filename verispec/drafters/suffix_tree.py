"""A suffix tree of token sequences with counts, the index behind SuffixDecoding (Oliaro et al. 2025).

It holds every string of at most `depth` tokens that occurs in its sequences, with how often it occurs: a trie of
their substrings, each node one string, its children the strings one token longer. From the node of a matched
suffix, a child's count over the counts of all its children is the empirical probability that this token follows
the suffix; `speculate` grows the likeliest continuations from there into a chain or a tree.

Memory: a string that occurs once keeps no children. What follows its one occurrence is read from the sequence
itself (the node keeps where that occurrence ends), so text seen once costs a node only where its suffixes branch
off from earlier text; the node's children are made the moment the string occurs a second time ("lazy" nodes).

Sequences grow one token at a time, several of them interleaved (the generations of a server). Each keeps the
positions of its suffixes of up to depth - 1 tokens (`TreeSequence.suffixes`): a node, or a lazy node and how many
tokens its string runs on past it. Appending a token counts it as the child of each suffix that keeps children,
longest suffix first: a shorter suffix's child can reach its second occurrence in the same append and make its own
first child from the earlier occurrence, which may be the longer suffix just extended, which must not count twice.
Counts only grow; a tree is dropped whole (see `suffix.SharedHistory`), never pruned.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Sequence


class _Node:
    """One string: how often it occurs, how many of those occurrences a token follows (the sum of the children's
    counts), its children (None while it occurs once), and where its latest occurrence ends (an exclusive index into
    the token list of the sequence holding it)."""

    __slots__ = ("count", "total", "children", "tokens", "end")

    def __init__(self, tokens: list[int], end: int) -> None:
        self.count, self.total, self.children = 1, 0, None
        self.tokens, self.end = tokens, end


Position = tuple[_Node, int]  # a node, and how many tokens the string runs on past it (0 unless the node is lazy)


@dataclass
class TreeSequence:
    """A sequence that a tree holds, and where each of its suffixes is in the tree: `suffixes[n]` for n = 0 ..
    min(len(tokens), depth - 1), the suffix of n tokens."""

    tokens: list[int] = field(default_factory=list)
    suffixes: list[Position] = field(default_factory=list)


@dataclass(frozen=True)
class Candidate:
    """A proposal: tokens with parents (-1: the root) in the order drawn, and each one's estimated probability (of
    its whole path from the root: the chance that it is accepted, if the counts were the model's own odds); `score`
    sums them (the expected number accepted); `match` is the suffix's length."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


NOTHING = Candidate([], [], [])


@dataclass(frozen=True)
class Limits:
    """How much one speculation may propose: at most `nodes` tokens and `factor` x the matched suffix's length
    (SuffixDecoding's max_spec_factor), at most `depth` deep, only tokens whose path's estimated probability is at
    least `min_prob`; `tree`: the likeliest continuations wherever they branch, else one chain."""

    nodes: int
    depth: int
    factor: float
    min_prob: float
    tree: bool


class SuffixTree:
    """The substrings of up to `depth` tokens of its sequences, with counts. Not thread-safe: its owner locks it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node([], 0)
        self.root.children = {}
        self.tokens = 0  # held, over all its sequences

    def sequence(self) -> TreeSequence:
        """A new, empty sequence in this tree."""
        return TreeSequence([], [(self.root, 0)])

    def extend(self, sequence: TreeSequence, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._append(sequence, int(token))

    def _append(self, sequence: TreeSequence, token: int) -> None:
        tokens = sequence.tokens
        tokens.append(token)  # first: an earlier occurrence whose child is made below may be followed by it
        self.tokens += 1
        end, grown = len(tokens), []
        for n in range(len(sequence.suffixes) - 1, -1, -1):  # longest first (see the module's notes)
            node, extra = self._resolve(sequence.suffixes[n], tokens, end - 1)
            if extra == 0 and node.children is not None:
                child = node.children.get(token)
                if child is None:
                    node.children[token] = child = _Node(tokens, end)
                else:
                    child.count += 1
                    if child.children is None:  # its second occurrence: its first one's child, from the text
                        self._branch(child, n + 1)
                    child.tokens, child.end = tokens, end
                node.total += 1
                grown.append((child, 0))
            else:  # inside a string seen once: nothing to count, the text itself holds what follows
                grown.append((node, extra + 1))
        grown.reverse()  # grown[n]: the suffix of n + 1 tokens
        sequence.suffixes = [(self.root, 0), *grown[: self.depth - 1]]

    def _branch(self, node: _Node, depth: int) -> None:
        """A string seen once is seen again: its children are made, the one that followed its first occurrence."""
        node.children = {}
        if depth < self.depth and node.end < len(node.tokens):
            node.children[node.tokens[node.end]] = _Node(node.tokens, node.end + 1)
            node.total = 1

    @staticmethod
    def _resolve(position: Position, tokens: Sequence[int], end: int) -> Position:
        """The position of the string tokens[end - n: end] (n = its length), moved down past nodes that have made
        children since it was recorded."""
        node, extra = position
        while extra and node.children is not None:
            node, extra = node.children[tokens[end - extra]], extra - 1
        return node, extra

    def _step(self, position: Position, token: int) -> Position | None:
        """The position of the string one token longer, None where it does not occur."""
        node, extra = position
        if extra == 0 and node.children is not None:
            child = node.children.get(token)
            return None if child is None else (child, 0)
        at = node.end + extra
        return (node, extra + 1) if at < len(node.tokens) and node.tokens[at] == token else None

    def _next(self, position: Position, length: int) -> tuple[list[tuple[int, int, Position]], int]:
        """What follows the string at `position` (`length` tokens long): (token, count, position) for each
        continuation, and their total count."""
        node, extra = position
        if length >= self.depth:
            return [], 0
        if extra == 0 and node.children is not None:
            return [(token, child.count, (child, 0)) for token, child in node.children.items()], node.total
        at = node.end + extra
        return ([(node.tokens[at], 1, (node, extra + 1))], 1) if at < len(node.tokens) else ([], 0)

    def matches(self, pattern: Sequence[int]) -> list[tuple[int, Position]]:
        """(length, position) of each suffix of `pattern` that occurs here, longest first (at most depth - 1 long:
        a continuation must fit)."""
        out = []
        for n in range(1, min(len(pattern), self.depth - 1) + 1):  # a suffix that does not occur ends the search:
            position: Position | None = (self.root, 0)  # no longer one occurs either
            for token in pattern[len(pattern) - n :]:
                position = self._step(position, token)
                if position is None:
                    return out[::-1]
            out.append((n, position))
        return out[::-1]

    def own_matches(self, sequence: TreeSequence) -> list[tuple[int, Position]]:
        """`matches(sequence.tokens)` for a sequence of this tree, read from the positions it keeps of its suffixes
        (each occurs: in the sequence itself) rather than walked from the root, suffix by suffix."""
        tokens, end = sequence.tokens, len(sequence.tokens)
        return [(n, self._resolve(sequence.suffixes[n], tokens, end)) for n in range(len(sequence.suffixes) - 1, 0, -1)]

    def speculate(self, pattern: Sequence[int], limits: Limits) -> Candidate:
        """The best-scoring proposal over every matched suffix of `pattern` (ties: the longer match)."""
        return self._best_of(self.matches(pattern), limits)

    def speculate_own(self, sequence: TreeSequence, limits: Limits) -> Candidate:
        """`speculate(sequence.tokens, limits)` for a sequence of this tree, its matches read from the positions it
        keeps (`own_matches`)."""
        return self._best_of(self.own_matches(sequence), limits)

    def _best_of(self, matches: list[tuple[int, Position]], limits: Limits) -> Candidate:
        best = NOTHING
        for n, position in matches:
            following, total = self._next(position, n)
            likeliest = max((count for _, count, _ in following), default=0) / (total or 1)
            if min(limits.nodes, int(limits.factor * n + 1e-9)) * likeliest <= best.score:
                continue  # each proposed token's probability is at most the likeliest first one's: no higher score
            candidate = self._grow(position, n, limits)
            if candidate.score > best.score:
                best = candidate
        return best

    def _grow(self, position: Position, length: int, limits: Limits) -> Candidate:
        """The likeliest continuations of the string at `position`: best first, each after its parent."""
        budget = min(limits.nodes, int(limits.factor * length + 1e-9))
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        order = itertools.count()  # breaks ties in the order the children were seen
        heap = self._children(position, length, 1.0, -1, 0, limits, order)
        heapq.heapify(heap)
        while heap and len(tokens) < budget:  # a chain's heap never holds more than one entry
            neg_prob, _, token, child, parent, depth = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg_prob)
            if depth < limits.depth:
                for kid in self._children(child, length + depth, -neg_prob, len(tokens) - 1, depth, limits, order):
                    heapq.heappush(heap, kid)
        return Candidate(tokens, parents, probs, length)

    def _children(
        self, position: Position, length: int, prob: float, parent: int, depth: int, limits: Limits, order
    ) -> list:
        """Heap entries for the continuations of `position` worth proposing: all of them in a tree, the most
        frequent (the first seen among equals) in a chain."""
        following, total = self._next(position, length)
        kids = [
            (-prob * count / total, next(order), token, child, parent, depth + 1)
            for token, count, child in following
            if prob * count / total >= limits.min_prob
        ]
        return kids if limits.tree else sorted(kids)[:1]
