"""Drafters: each proposes tokens for the target to verify, behind the `Drafter` protocol."""

from verispec.drafters.base import Drafter, Proposal, SideBranch, Verdict
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.layer_skip import LayerSkip
from verispec.drafters.lookahead import Lookahead
from verispec.drafters.ngram import PromptLookup

__all__ = ["Drafter", "DraftModel", "LayerSkip", "Lookahead", "PromptLookup", "Proposal", "SideBranch", "Verdict"]
