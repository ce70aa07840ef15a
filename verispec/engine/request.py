"""What a caller hands the engine (a `Request`) and what each engine step hands back per request (an `Update`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.grammar import Grammar, TokenGrammar
from verispec.sampling import SamplingParams
from verispec.stats import GenerationStats

FINISH_REASONS = ("eos", "stop_string", "max_new_tokens", "context_length", "aborted", "error")


@dataclass(frozen=True)
class Request:
    """One generation: the prompt's token ids and the options `verispec.generate` takes. `grammar`: what the output
    must follow; a `TokenGrammar` bound to the engine's target is compiled already (the server binds on its request
    threads, so that the engine's thread never waits for a grammar to compile)."""

    prompt: list[int]  # token ids: non-empty, in the target's vocabulary, shorter than its context
    max_new_tokens: int
    sampling: SamplingParams
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | TokenGrammar | None = None


@dataclass
class Update:
    """What one engine step produced for one request.

    `tokens` are the ids committed in this step (an EOS that ended the request included); `text` is the text released
    in this step, which may lag the tokens while it could still be the start of a stop string (held back, exactly as
    `verispec.stream` holds it back) and is all released by the request's last update. `drafted` says, per token,
    whether it was an accepted proposal. A request that failed on its own (its sampling, its drafter) ends with
    finish_reason "error" and the exception in `error`.
    """

    request_id: int
    text: str
    tokens: list[int]
    finished: bool
    finish_reason: str | None  # one of FINISH_REASONS once finished, None while running
    stats: GenerationStats  # the request's running stats (the same object each update)
    drafted: list[bool] = field(default_factory=list)
    error: Exception | None = None  # why it failed, when finish_reason is "error" (the other requests go on)
