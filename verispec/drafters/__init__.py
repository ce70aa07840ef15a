"""Drafters: each proposes tokens for the target to verify, behind the `Drafter` protocol."""

from verispec.drafters.base import Drafter, Proposal, SideBranch, Verdict
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.ngram import PromptLookup

__all__ = ["Drafter", "DraftModel", "PromptLookup", "Proposal", "SideBranch", "Verdict"]
