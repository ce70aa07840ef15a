"""`generate_batch`: several prompts through one engine, each decoded as `verispec.generate` would decode it alone."""

from __future__ import annotations

from typing import Sequence

from verispec.argument_checks import prompt_ids, stop_strings
from verispec.drafters.base import Drafter
from verispec.engine.engine import Engine
from verispec.engine.request import Request
from verispec.errors import InvalidArgumentError
from verispec.generate import Generation
from verispec.grammar import Grammar, TokenGrammar, bind, grammar_option
from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams


def generate_batch(
    target: CausalLM,
    prompts: Sequence[str | Sequence[int]],
    drafter: Drafter | None = None,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    max_batch: int = 16,
    adaptive: bool = True,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    grammar: str | Grammar | TokenGrammar | None = None,
) -> list[Generation]:
    """Decode every prompt (text or token ids) with `generate`'s options, up to `max_batch` at a time in one
    batched engine (`Engine`; `adaptive`: each step's k chosen from the batch size and measured costs, else the
    drafter's k every step); returns their generations in order. A `seed` seeds each prompt's own generator, as
    `generate` would seed it for that prompt alone. A grammar (`json_schema`, `regex` or `grammar`, as `generate` takes
    them) constrains every prompt's output. Where one prompt's generation fails, its error is raised."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise InvalidArgumentError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    sampling, stops = SamplingParams(temperature, top_k, top_p), tuple(stop_strings(stop))
    bound = bind(grammar_option(json_schema, regex, grammar), target, ignore_eos)  # compiled once for all
    engine = Engine(target, drafter, max_batch=max_batch, adaptive=adaptive)
    ids = [
        engine.add(Request(prompt_ids(target, p), max_new_tokens, sampling, seed, stops, ignore_eos, bound))
        for p in prompts
    ]
    tokens = {i: [] for i in ids}
    drafted = {i: [] for i in ids}
    text = {i: "" for i in ids}
    done = {}
    while engine.has_work:
        for update in engine.step():
            tokens[update.request_id] += update.tokens
            drafted[update.request_id] += update.drafted
            text[update.request_id] += update.text
            if update.error is not None:  # as `generate` would have raised for that prompt alone
                raise update.error
            if update.finished:
                done[update.request_id] = update
    return [Generation(text[i], tokens[i], drafted[i], done[i].finish_reason, done[i].stats) for i in ids]
