"""Checks and normalisation of the public entry points' arguments: what each accepts, in one place.

Every refusal is an `InvalidArgumentError` (or a `ContextLengthError` for a prompt that fills the context), never a
TypeError from deeper down; values come back as plain Python types, so numpy and torch scalars work like ints.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any, NamedTuple

import numpy as np
import torch

from verispec.errors import ContextLengthError, InvalidArgumentError
from verispec.models.protocol import CausalLM

PROMPT_TYPES = "a str, or token ids as a list, a tuple, or a 1-D integer tensor or array"
MAX_STOP_STRINGS = 16  # OpenAI allows 4, vLLM any number; matching costs grow with their count
MAX_STOP_CHARS = 1024  # characters in one stop string; matching holds back at most this much text


def whole_number(value: Any, name: str, least: int = 0) -> int:
    """`value` as an int: any integer type (numpy's and torch's integer scalars too) but bool, at least `least`."""
    if not isinstance(value, Integral) or isinstance(value, bool) or value < least:
        raise InvalidArgumentError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def real_number(value: Any, name: str) -> float:
    """`value` as a float: any real number type but bool (a bool here is a mistake, not 0 or 1)."""
    if not isinstance(value, Real) or isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    return float(value)


def unicode_text(text: str, name: str) -> str:
    """`text`, refused if it holds a lone surrogate (as JSON's "\\ud800" decodes to): it has no UTF-8 form, so no
    tokenizer can read it and no output can contain it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArgumentError(
            f"{name} is not valid Unicode: a lone surrogate {text[err.start]!r} at character {err.start}"
        ) from None
    return text


def prompt_ids(target: CausalLM, prompt: Any) -> list[int]:
    """The prompt's token ids: text is encoded with the tokenizer's own special tokens (e.g. BOS), ids are checked
    against the model's vocabulary and the context."""
    if isinstance(prompt, str):
        ids = target.tokenizer.encode(unicode_text(prompt, "the prompt"), add_special_tokens=True).ids
    elif isinstance(prompt, (torch.Tensor, np.ndarray)):
        integer = (
            prompt.dtype.kind in "iu"
            if isinstance(prompt, np.ndarray)
            else not (prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool)
        )
        if prompt.ndim != 1 or not integer:
            raise InvalidArgumentError(
                f"the prompt must be {PROMPT_TYPES}; got a {prompt.ndim}-D {type(prompt).__name__} of {prompt.dtype}"
            )
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple, range)):
        # bool is an int to Python, but [True] is a mistake, not token 1
        if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
            raise InvalidArgumentError(f"prompt token ids must be integers, got {list(prompt)[:8]!r}")
        ids = [int(t) for t in prompt]
    else:  # bytes in particular: iterating them gives ints, which are not token ids
        raise InvalidArgumentError(f"the prompt must be {PROMPT_TYPES}; got {type(prompt).__name__}")
    if not ids:
        raise InvalidArgumentError("the prompt is empty")
    if not all(0 <= t < target.vocab_size for t in ids):
        raise InvalidArgumentError(f"prompt token ids must be integers in [0, {target.vocab_size})")
    if len(ids) >= target.context_length:
        raise ContextLengthError(f"the prompt has {len(ids)} tokens; the context holds {target.context_length}")
    return ids


def stop_strings(stop: Any) -> list[str]:
    """One stop string or several; None for none. An empty string would stop before the first token."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}")
    if "" in stops:
        raise InvalidArgumentError("stop strings must not be empty")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidArgumentError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
    for s in stops:
        unicode_text(s, "a stop string")
    return list(stops)


def seed_value(seed: Any) -> int | None:
    if seed is not None and not (isinstance(seed, Integral) and not isinstance(seed, bool) and 0 <= seed < 2**63):
        raise InvalidArgumentError(f"seed must be an integer in [0, 2**63) or None, got {seed!r}")
    return None if seed is None else int(seed)


class GenerationArgs(NamedTuple):
    prompt: list[int]
    max_new_tokens: int
    seed: int | None
    stop: list[str]


def generation_args(target: CausalLM, prompt: Any, *, max_new_tokens: Any, seed: Any, stop: Any) -> GenerationArgs:
    """`stream`'s arguments checked, cheapest first, before any model runs."""
    stops = stop_strings(stop)
    limit = whole_number(max_new_tokens, "max_new_tokens", 1)
    return GenerationArgs(prompt_ids(target, prompt), limit, seed_value(seed), stops)
