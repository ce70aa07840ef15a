"""Drafters: each proposes tokens for the target to verify, behind the `Drafter` protocol (base.py); the registry
builds one from a method record."""

from verispec.drafters.base import DraftContext, Drafter, DraftSession, Needs, Proposal, SideBranch, Verdict
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.layer_skip import LayerSkip
from verispec.drafters.lookahead import Lookahead
from verispec.drafters.ngram import PromptLookup
from verispec.drafters.registry import FAMILIES, Method, Resources, build_drafter, resolve_method
from verispec.drafters.suffix import SuffixDecoding

__all__ = [
    "DraftContext",
    "DraftModel",
    "DraftSession",
    "Drafter",
    "FAMILIES",
    "LayerSkip",
    "Lookahead",
    "Method",
    "Needs",
    "PromptLookup",
    "Proposal",
    "Resources",
    "SideBranch",
    "SuffixDecoding",
    "Verdict",
    "build_drafter",
    "resolve_method",
]
