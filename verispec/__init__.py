"""verispec: lossless speculative decoding for Llama-family language models."""

from verispec import collector, openmp  # noqa: F401  (first: before torch loads OpenMP, collection paused)

try:
    from verispec.drafters import (
        DraftContext,
        Drafter,
        DraftModel,
        DraftSession,
        LayerSkip,
        Lookahead,
        Method,
        Needs,
        PromptLookup,
        Proposal,
        Resources,
        SideBranch,
        SuffixDecoding,
        Verdict,
        build_drafter,
        resolve_method,
    )
    from verispec.drafters.adaptive import AdaptiveK
    from verispec.engine import Engine, Request, Update, generate_batch
    from verispec.errors import (
        CheckpointError,
        ContextLengthError,
        DrafterError,
        GrammarError,
        IncompatibleTargetError,
        InvalidArgumentError,
        PeerError,
        TokenizerMismatchError,
        UnsupportedArchitectureError,
        VerispecError,
    )
    from verispec.generate import Generation, Stream, generate, stream
    from verispec.grammar import Grammar, TokenGrammar, bind
    from verispec.models.auto import load
    from verispec.models.hf_adapter import TransformersModel, load_transformers_model
    from verispec.models.native import NativeModel, load_default, load_model
    from verispec.sampling import SamplingParams
    from verispec.stats import GenerationStats
    from verispec.threads import default_threads, set_threads, torch_threads
finally:
    collector.resume()

__all__ = [
    "AdaptiveK",
    "CheckpointError",
    "ContextLengthError",
    "DraftContext",
    "DraftModel",
    "DraftSession",
    "Drafter",
    "DrafterError",
    "Engine",
    "Generation",
    "GenerationStats",
    "Grammar",
    "GrammarError",
    "IncompatibleTargetError",
    "InvalidArgumentError",
    "LayerSkip",
    "Lookahead",
    "Method",
    "NativeModel",
    "Needs",
    "PeerError",
    "PromptLookup",
    "Proposal",
    "Request",
    "Resources",
    "SamplingParams",
    "SideBranch",
    "Stream",
    "SuffixDecoding",
    "TokenGrammar",
    "TokenizerMismatchError",
    "TransformersModel",
    "UnsupportedArchitectureError",
    "Update",
    "Verdict",
    "VerispecError",
    "bind",
    "build_drafter",
    "resolve_method",
    "default_threads",
    "generate",
    "generate_batch",
    "load",
    "load_default",
    "load_model",
    "load_transformers_model",
    "set_threads",
    "stream",
    "torch_threads",
]
