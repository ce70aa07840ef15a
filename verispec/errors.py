"""Exceptions raised at verispec's entry points; the CLI turns each into one line and exit code 2."""


class VerispecError(Exception):
    """Base class for every error verispec raises on bad input."""


class CheckpointError(VerispecError):
    """A checkpoint folder is missing, incomplete or unreadable."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture is not one the native runtime implements."""


class InvalidArgumentError(VerispecError, ValueError):
    """A generation argument is out of range (k, temperature, top-p, prompt, ...)."""


class ContextLengthError(VerispecError):
    """The prompt (or a write to a KV cache) does not fit in the context length."""


class IncompatibleTargetError(VerispecError):
    """A drafter cannot draft for this target: it lacks a capability the drafter needs (tree masks, hidden states,
    layer subsets), or its tokenizer or layers do not match."""


class TokenizerMismatchError(IncompatibleTargetError):
    """Draft and target do not share a tokenizer."""


class DrafterError(VerispecError):
    """A drafter broke its protocol: a proposal deeper than asked or wider than it declared, siblings the rule
    cannot verify losslessly."""


class PeerError(VerispecError):
    """A benchmark peer outside verispec (llama.cpp's binaries) is missing, failed, or printed what cannot be read."""


class PeerUnavailable(PeerError):
    """A benchmark peer cannot be given this checkpoint (llama.cpp a folder whose tokenizer the GGUF writer refuses):
    its rows are left out, with a note that says how to give it one."""


class GrammarError(InvalidArgumentError):
    """A JSON schema, regular expression or grammar that cannot be compiled, or cannot be used with this model (its
    tokenizer, or a vocabulary in which the grammar cannot be completed)."""
