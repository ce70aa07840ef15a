"""verispec: lossless speculative decoding for Llama-family language models."""

from verispec.drafters import DraftModel, Drafter, LayerSkip, Lookahead, PromptLookup, Proposal, SideBranch, Verdict
from verispec.errors import (CheckpointError, ContextLengthError, DrafterError, IncompatibleTargetError,
                             InvalidArgumentError, TokenizerMismatchError, UnsupportedArchitectureError, VerispecError)
from verispec.generate import Generation, Stream, generate, stream
from verispec.models.auto import load
from verispec.models.default import load_default
from verispec.models.hf_adapter import TransformersModel, load_transformers_model
from verispec.models.native import NativeModel, load_model
from verispec.sampling import SamplingParams
from verispec.stats import GenerationStats

__all__ = [
    "CheckpointError", "ContextLengthError", "DraftModel", "Drafter", "DrafterError", "Generation",
    "GenerationStats", "IncompatibleTargetError", "InvalidArgumentError", "LayerSkip", "Lookahead", "NativeModel", "PromptLookup", "Proposal",
    "SamplingParams", "SideBranch", "Stream", "TokenizerMismatchError", "TransformersModel",
    "UnsupportedArchitectureError", "Verdict", "VerispecError", "generate", "load", "load_default", "load_model",
    "load_transformers_model", "stream",
]
