"""verispec: lossless speculative decoding for Llama-family language models."""

from verispec.drafters import DraftModel, Drafter, Proposal
from verispec.errors import (CheckpointError, ContextLengthError, InvalidArgumentError, TokenizerMismatchError,
                             UnsupportedArchitectureError, VerispecError)
from verispec.generate import Generation, Stream, generate, stream
from verispec.models.native import NativeModel, load_model
from verispec.sampling import SamplingParams
from verispec.stats import GenerationStats

__all__ = [
    "CheckpointError", "ContextLengthError", "DraftModel", "Drafter", "Generation", "GenerationStats",
    "InvalidArgumentError", "NativeModel", "Proposal", "SamplingParams", "Stream", "TokenizerMismatchError",
    "UnsupportedArchitectureError", "VerispecError", "generate", "load_model", "stream",
]
