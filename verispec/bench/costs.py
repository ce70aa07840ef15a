"""The bench's cost model: what one step of each of our methods costs, in units of one target step (batch one),
priced before the run from forwards timed apart, so that the report can set each row's predicted speedup beside the
measured one. The run-time model that chooses k (cost_model.py) prices steps from the generation's own timings.

Every price is a median of timed forwards (`models/timing.py`) over the target's one-token forward:
- a chain (draft model, prompt lookup, layer skip, EAGLE's chain) has c, one drafting step; a step that verified j
  drafts costs j c + r(j + 1).
- a token tree (draft model with branch > 1, EAGLE-2, Medusa) has a table by the depth d the run recorded for a step:
  `draft[d]`, its drafting, plus r(`tokens[d]`), its one target forward (the last committed token and the tree).
- lookahead, a suffix tree and suffix with EAGLE have none (NO_PRICE).
r(n) is the target's time for n tokens over its time for 1, up to the widest forward any row verifies.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from verispec.bench.bandwidth import read_bandwidth, weight_bytes
from verispec.bench.methods import DRAFT_KS, BenchMethod
from verispec.drafters.base import Drafter
from verispec.drafters.draft_model import DraftModel, tree_size
from verispec.drafters.eagle import Eagle
from verispec.drafters.medusa import Medusa
from verispec.drafters.registry import AUTO
from verispec.models.forward_options import VocabHead
from verispec.models.native import NativeModel
from verispec.models.timing import forward_seconds, head_step_seconds, medusa_step_seconds

LOOKAHEAD_NOTE = (
    "no prediction: its forward holds the Jacobi window and a trie of the pool's n-grams after the last "
    "token (up to candidates x (ngram - 1) tokens), a size the run does not record, and r(n) varies over "
    "that range"
)
SUFFIX_NOTE = (
    "no prediction: the run does not record its trees' sizes (at most spec_factor x each step's match, and "
    "tree_tokens), nor, with eagle_below, which steps the EAGLE head drafted"
)
NO_PRICE = {"lookahead": LOOKAHEAD_NOTE, "suffix": SUFFIX_NOTE}  # why a family's rows may have no prediction


@dataclass
class Prices:
    """Timed forwards in units of the target's one-token forward `one`, each timed once (a tree's one-token draft
    forward is the chain's c, not a second noisy sample of it)."""

    target: NativeModel
    one: float
    _seen: dict = field(default_factory=dict)

    def forward(
        self, model: NativeModel, tokens: int, layers: Sequence[int] | None = None, head: VocabHead | None = None
    ) -> float:
        key = ("forward", id(model), tokens, None if layers is None else tuple(layers), id(head))
        if key not in self._seen:
            self._seen[key] = forward_seconds(model, tokens, layers=layers, head=head) / self.one
        return self._seen[key]

    def head(self, drafter: Eagle, width: int = 1) -> float:
        """An EAGLE step over `width` features: the head, and the LM head at its draft vocabulary's width."""
        key = ("head", id(drafter.head), None if drafter.vocab is None else len(drafter.vocab), width)
        if key not in self._seen:
            self._seen[key] = head_step_seconds(self.target, drafter.head, key[2], width=width) / self.one
        return self._seen[key]

    def medusa(self, drafter: Medusa) -> float:
        """A Medusa step: every head over one feature, with LM heads at its draft vocabulary's width."""
        return medusa_step_seconds(self.target, drafter.heads, drafter.vocab) / self.one


def timing(
    target: NativeModel, draft: NativeModel | None, methods: list[BenchMethod], skip: Sequence[int] | None = None
) -> dict:
    """c per chain method (prompt lookup runs no model; layer skip runs the target without the layers `skip`), a
    table per tree method (TREE_COSTS), and r(n) for n = 1 .. the widest forward of any row (max chain k + 1 at
    least)."""
    one, bandwidth = step_and_bandwidth(target)
    prices = Prices(target, one)
    kept = [i for i in range(target.config.num_hidden_layers) if i not in (skip or ())]
    c: dict[str, float] = {}
    trees: dict[str, dict] = {}
    for m in (m for m in methods if m.drafter is not None):
        family = m.method.family
        if m.drafter.needs.tree_masks:
            if family in TREE_COSTS:
                trees[m.label] = TREE_COSTS[family](_drafting(m), prices)
        elif family == "eagle":  # an EAGLE step's cost depends on how wide its LM head is
            c[m.label] = prices.head(_drafting(m))
        elif family == "draft" and draft is not None:  # the unrelated draft has the real one's shape and cost
            c[m.label] = prices.forward(draft, 1, head=_drafting(m).head)  # (at its draft vocabulary's width)
        elif family == "selfquant":  # its own twin's step
            c[m.label] = prices.forward(_drafting(m).model, 1)
        elif family == "layerskip" and skip:
            c[m.label] = prices.forward(target, 1, kept)
        elif family == "ngram" or (family == "suffix" and not m.drafter.needs.hidden_states):
            c[m.label] = 0.0  # no model (a suffix tree's lookups, as prompt lookup's, are left out)
    widest = max([max(DRAFT_KS) + 1, *(n for tree in trees.values() for n in tree["tokens"])])
    return {
        "c": c,
        "trees": trees,
        "r": {1: 1.0} | {n: prices.forward(target, n) for n in range(2, widest + 1)},
        "target_step_seconds": prices.one,
        "weight_bytes": weight_bytes(target),
        "read_bandwidth": bandwidth,
    }


def step_and_bandwidth(target: NativeModel, rounds: int = 7) -> tuple[float, float]:
    """The target's one-token forward (seconds) and the read bandwidth (bytes per second), measured in turns over
    `rounds` rounds, medians: the machine's changing load falls on both alike, so their ratio holds."""
    ones, bandwidths = [], []
    for _ in range(rounds):
        ones.append(forward_seconds(target, 1))
        bandwidths.append(read_bandwidth(repeats=3))
    return statistics.median(ones), statistics.median(bandwidths)


def _drafting(method: BenchMethod) -> Drafter:
    """The drafter that drafts: the registry wraps a `k=auto` method's in AdaptiveK, which only chooses k."""
    return method.drafter.drafter if method.method.k == AUTO else method.drafter


def _draft_tree(drafter: DraftModel, prices: Prices) -> dict:
    """Priced by the recorded depth, which is what it drafted: a draft-model tree always reaches the depth it is
    asked for (the bench ignores EOS, so nothing cuts it). Depth d is one draft forward over the tokens it has not
    seen (priced at one token, as the chain's c is), then one over each depth's frontier (b^min(i, branch_depth)
    nodes at depth i) for i < d; the target verifies the tree_size(d) nodes and the root."""
    b, bd = drafter.branch, drafter.branch_depth
    frontier = [b ** min(i, bd) for i in range(drafter.k)]  # [i]: nodes at depth i, each a row of a draft forward
    draft = [
        sum(prices.forward(drafter.model, w, head=drafter.head) for w in frontier[:d]) for d in range(drafter.k + 1)
    ]
    return {"draft": draft, "tokens": [1 + tree_size(d, b, bd) for d in range(drafter.k + 1)]}


def _eagle_tree(drafter: Eagle, prices: Prices) -> dict:
    """Every drafted step at the drafter's full size, not by the recorded depth: EAGLE-2 keeps the best `tree_tokens`
    of all it drew wherever they lie, so the depth recorded is the kept tree's, not the k it drafted. Full size is
    what it drafts on every step but a generation's last few (fewer than k tokens left: fewer depths, priced high).
    Drafting is the head over the new committed features and the LM head at the root (one wide, as the chain's c),
    then k - 1 expansions, each one head call over the top_k frontier and the LM head over its top_k features."""
    top_k, total = drafter.tree
    draft = prices.head(drafter) + (drafter.k - 1) * (prices.head(drafter, top_k) if drafter.k > 1 else 0.0)
    drawn, frontier = 0, 1
    for _ in range(drafter.k):  # each frontier node draws its top_k children; the best top_k are expanded next
        drawn += frontier * top_k
        frontier = min(top_k, frontier * top_k)
    return {"draft": [0.0] + [draft] * drafter.k, "tokens": [1] + [1 + min(total, drawn)] * drafter.k}


def _medusa_tree(drafter: Medusa, prices: Prices) -> dict:
    """Priced by the recorded depth: the recorded depth d is the k asked, capped at the deepest path, and the tree
    holds every path up to d deep (paths are prefix-closed), all verified with the root; drafting is one call of
    every head, whatever d."""
    return {
        "draft": [0.0] + [prices.medusa(drafter)] * drafter.k,
        "tokens": [1 + sum(len(path) <= d for path in drafter.paths) for d in range(drafter.k + 1)],
    }


# Per tree family: {"draft": [d] drafting in target steps, "tokens": [d] tokens in the target's forward}, for
# d = 0 .. the drafter's k, d the depth the run recorded for a step (0: a plain step, nothing drafted).
TREE_COSTS = {"draft": _draft_tree, "selfquant": _draft_tree, "eagle": _eagle_tree, "medusa": _medusa_tree}
