"""The bench's cost model of a tree step (bench/costs.py): each drafter's forwards and verified tokens by depth, and
the predicted speedup it gives a row. Prices here are made up, so nothing is timed."""

from __future__ import annotations

import pytest

from verispec.bench.costs import TREE_COSTS
from verispec.bench.summary import summarize
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.eagle import Eagle
from verispec.drafters.medusa import Medusa
from verispec.heads.eagle import EagleHead, head_config
from verispec.heads.medusa import MedusaHeads


class MadeUpPrices:
    """Stands in for costs.Prices: a forward of w tokens costs 0.1 w, an EAGLE step over w features 0.2 + 0.01 w, a
    Medusa step 0.3 (target steps)."""

    def forward(self, model, tokens: int, head=None) -> float:
        return 0.1 * tokens

    def head(self, drafter: Eagle, width: int = 1) -> float:
        return 0.2 + 0.01 * width

    def medusa(self, drafter: Medusa) -> float:
        return 0.3


def test_a_draft_model_tree_is_priced_by_its_frontiers(draft) -> None:
    table = TREE_COSTS["draft"](DraftModel(draft, 4, branch=2), MadeUpPrices())
    # depth d: one forward over the unseen token, then the 2-node frontier of each depth 1 .. d - 1
    assert table["draft"] == pytest.approx([0.0, 0.1, 0.3, 0.5, 0.7])
    assert table["tokens"] == [1, 3, 5, 7, 9]  # the root and 2 nodes per depth
    deep = TREE_COSTS["draft"](DraftModel(draft, 3, branch=2, branch_depth=2), MadeUpPrices())
    assert deep["draft"] == pytest.approx([0.0, 0.1, 0.3, 0.7]) and deep["tokens"] == [1, 3, 7, 11]


def test_an_eagle_tree_is_priced_at_its_full_size(target) -> None:
    head = EagleHead(head_config(target.config))
    table = TREE_COSTS["eagle"](Eagle(head, 5, tree=(4, 15)), MadeUpPrices())
    # the root's step, then four expansions of a 4-node frontier, whatever depth the kept tree reached
    assert table["draft"] == pytest.approx([0.0] + [0.21 + 4 * 0.24] * 5) and table["tokens"] == [1] + [16] * 5
    shallow = TREE_COSTS["eagle"](Eagle(head, 1, tree=(4, 15)), MadeUpPrices())
    assert shallow["draft"] == pytest.approx([0.0, 0.21]) and shallow["tokens"] == [1, 5]  # only 4 drawn


def test_a_medusa_tree_is_one_heads_call_and_its_paths_up_to_the_depth(target) -> None:
    heads = MedusaHeads.from_target(target.lm_head_weight.detach(), 3)
    drafter = Medusa(heads, [[0.6, 0.3], [0.5, 0.1], [0.4, 0.1]], tokens=5)  # paths (0,) (1,) (0,0) (1,0) (0,0,0)
    table = TREE_COSTS["medusa"](drafter, MadeUpPrices())
    assert table["draft"] == pytest.approx([0.0, 0.3, 0.3, 0.3]) and table["tokens"] == [1, 3, 5, 6]


def test_a_tree_row_is_predicted_tau_over_its_step_cost() -> None:
    """Per prompt: two steps 3 deep and one plain step (the last), 7 tokens in 3 target calls."""
    records = [
        {
            "method": m,
            "id": i,
            "category": "code",
            "repeat": 0,
            "tokens": list(range(7)),
            "seconds": s,
            "prefill_seconds": 0.5,
            "draft_seconds": 0.0,
            "verify_seconds": 0.0,
            "target_calls": calls,
            "proposed_by_position": prop,
            "accepted_by_position": acc,
        }
        for i in ("a", "b")
        for m, s, calls, prop, acc in (("autoregressive", 7.5, 7, [], []), ("medusa", 3.5, 3, [2, 2, 2], [2, 1, 1]))
    ]
    trees = {"medusa": {"draft": [0.0, 0.3, 0.3, 0.3], "tokens": [1, 3, 5, 6]}}
    r = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4, 6: 1.5}
    entry = summarize(records, {}, r, trees=trees)["medusa"]["all"]
    step_cost = (2 * (0.3 + 1.5) + 1 * 1.0) / 3
    assert entry["tau"] == pytest.approx(7 / 3)
    assert entry["predicted_speedup"] == pytest.approx((7 / 3) / step_cost)
    assert entry["efficiency"] == pytest.approx((7.0 / 3.0) / entry["predicted_speedup"])  # decoding-only: 7 s / 3 s
    assert "predicted_speedup" not in summarize(records, {}, r)["medusa"]["all"]  # no table, no model
