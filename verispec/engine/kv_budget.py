"""The engine's key/value memory: a context length per request, and one budget of cache positions that the running
requests share, as llama.cpp's server shares its KV cells among its slots and vLLM pages within a memory budget.

A request reserves, when it joins, the positions it can come to hold (its prompt, its answer and a step's drafts, at
most the context length), and gives them back when it ends; one that does not fit waits for room, and one that could
never fit is refused when it is added. The caches on verispec's kernels hold no more than a request reserves
(models/slot_caches.py), so the process never grows past the budget for its caches.
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.errors import ContextLengthError, InvalidArgumentError
from verispec.models.cache import in_blocks

DEFAULT_CONTEXT = 8192  # a request's positions where the model's context is longer (--max-model-len)
DEFAULT_MEMORY = 2 * 2**30  # bytes of keys and values for all running requests together (--kv-cache-memory)


@dataclass
class KVBudget:
    """`context`: the positions one request may hold; `positions`: those all running requests may hold together;
    `bytes_per_position`: what a position's keys and values take in every layer."""

    context: int
    positions: int
    bytes_per_position: int
    reserved: int = 0  # positions the running requests hold or may come to

    @staticmethod
    def context_for(model_context: int, context: int | None) -> int:
        """A request's positions: `context` (--max-model-len), default the smaller of the model's and
        DEFAULT_CONTEXT."""
        if context is not None and not 1 <= context <= model_context:
            raise InvalidArgumentError(
                f"--max-model-len must be from 1 to the model's context, {model_context}; got {context}"
            )
        return min(model_context, DEFAULT_CONTEXT) if context is None else context

    @staticmethod
    def memory(memory: int | None) -> int:
        """The bytes of the budget: `memory` (--kv-cache-memory), default DEFAULT_MEMORY."""
        if memory is not None and memory < 1:
            raise InvalidArgumentError(f"--kv-cache-memory must be a positive number of bytes, got {memory}")
        return DEFAULT_MEMORY if memory is None else memory

    def need(self, prompt: int, max_new_tokens: int, drafts: int) -> int:
        """The positions a request reserves: what its cache can come to hold, in whole blocks, within its context.
        A ContextLengthError for a prompt that leaves no room, an InvalidArgumentError for a request that could
        never fit the budget."""
        if prompt >= self.context:
            raise ContextLengthError(
                f"this server's context length is {self.context} tokens (--max-model-len); the prompt has {prompt}"
            )
        positions = min(self.context, in_blocks(prompt + max_new_tokens + drafts))
        if positions > self.positions:
            raise InvalidArgumentError(
                f"this request may come to hold {positions} positions, "
                f"{_mib(positions * self.bytes_per_position)} of keys and values: more than "
                f"the whole --kv-cache-memory, {_mib(self.positions * self.bytes_per_position)}"
                f"; ask for fewer tokens"
            )
        return positions

    def fits(self, positions: int) -> bool:
        return self.reserved + positions <= self.positions

    def take(self, positions: int) -> None:
        self.reserved += positions

    def give(self, positions: int) -> None:
        self.reserved -= positions


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 10**3,
    "kib": 2**10,
    "m": 2**20,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
    "t": 2**40,
    "tb": 10**12,
    "tib": 2**40,
}


def byte_size(text: str) -> int:
    """A size as written on a command line ("2GiB", "512MiB", "1.5G", "1000000"): its bytes; ValueError otherwise."""
    number = text.strip().lower().rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text.strip().lower()[len(number) :].strip()
    if unit not in UNITS or not number:
        raise ValueError(f"not a size: {text!r}")
    return int(float(number) * UNITS[unit])
