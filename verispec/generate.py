"""The loop that joins drafter, target, acceptance rule and cache; plain decoding is the same loop with no drafter."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Iterator, Sequence

import torch

from verispec.detokenize import Piece, TextTracker
from verispec.drafters.base import Drafter, Proposal
from verispec.errors import ContextLengthError, InvalidArgumentError
from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams
from verispec.stats import GenerationStats
from verispec.verify import verify


@dataclass
class Generation:
    text: str
    tokens: list[int]  # the new tokens (an EOS that ended the generation included)
    drafted: list[bool]  # per new token: an accepted proposal (True) or the target's own token (False)
    stop_reason: str  # "eos", "stop_string", "max_new_tokens" or "context_length"
    stats: GenerationStats


class Stream:
    """Iterate for the text `Piece` of each token as soon as it is accepted; `result` is set at the end."""

    def __init__(self, steps: Generator[Piece, None, Generation]) -> None:
        self._steps, self.result = steps, None

    def __iter__(self) -> Iterator[Piece]:
        self.result = yield from self._steps

    def close(self) -> None:
        self._steps.close()


def stream(target: CausalLM, prompt: str | Sequence[int], drafter: Drafter | None = None, *,
           max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False) -> Stream:
    """Speculative (or, with no drafter, plain autoregressive) decoding of one prompt, streamed."""
    sampling = SamplingParams(temperature, top_k, top_p)
    ids = target.tokenizer.encode(prompt, add_special_tokens=False).ids if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise InvalidArgumentError("the prompt is empty")
    if len(ids) >= target.context_length:
        raise ContextLengthError(f"the prompt has {len(ids)} tokens; the context holds {target.context_length}")
    if max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(not 0 <= t < target.vocab_size for t in ids):
        raise InvalidArgumentError(f"prompt token ids must be in [0, {target.vocab_size})")
    generator = torch.Generator(target.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    eos = None if ignore_eos else target.eos_token_id
    if drafter is not None:  # here, not in the loop, so that an incompatible drafter fails before any output
        drafter.begin(target, ids, sampling, generator)
    return Stream(_decode(target, ids, drafter, sampling, generator, max_new_tokens, eos, TextTracker(target.tokenizer, stop)))


def generate(target: CausalLM, prompt: str | Sequence[int], drafter: Drafter | None = None, **options) -> Generation:
    """Run `stream` to the end; same options."""
    steps = stream(target, prompt, drafter, **options)
    for _ in steps:
        pass
    return steps.result


def _decode(target: CausalLM, prompt: list[int], drafter: Drafter | None, sampling: SamplingParams,
            generator: torch.Generator, max_new_tokens: int, eos: int | None,
            text: TextTracker) -> Generator[Piece, None, Generation]:
    stats, start, V = GenerationStats(), time.perf_counter(), target.vocab_size
    cache, tokens = target.new_cache(), list(prompt)  # the cache holds every token but the last
    if len(tokens) > 1:
        target(torch.tensor([tokens[:-1]], device=target.device), cache)
    stats.prefill_time, stop_reason = time.perf_counter() - start, "max_new_tokens"
    outstanding = False  # a proposal the drafter has made and not yet heard back on
    try:
        while True:
            room = min(max_new_tokens - (len(tokens) - len(prompt)), target.context_length - len(tokens))
            if room <= 0:
                stop_reason = "max_new_tokens" if len(tokens) - len(prompt) >= max_new_tokens else "context_length"
                break
            t0 = time.perf_counter()
            proposal = Proposal([])
            if drafter is not None and room > 1:
                proposal, outstanding = drafter.propose(tokens, min(drafter.k, room - 1)), True
                stats.drafter_calls += 1
            draft = proposal.tokens[: proposal.tokens.index(eos) + 1] if eos in proposal.tokens else proposal.tokens
            t1 = time.perf_counter()
            logits = target(torch.tensor([[tokens[-1], *draft]], device=target.device), cache)[:, :, :V]  # (1, k+1, V)
            q = None if proposal.probs is None else proposal.probs[: len(draft)]
            n, nxt = verify(draft, q, logits, sampling, generator)
            cache.truncate(len(tokens) + n)  # the old last token and the accepted drafts; nxt is the new last
            if outstanding:
                drafter.accepted(n)
                outstanding = False
            stats.draft_time, stats.verify_time = stats.draft_time + t1 - t0, stats.verify_time + time.perf_counter() - t1
            stats.target_calls += 1
            stats.record_step(len(draft), n)
            new, drafted = [*draft[:n], nxt], [True] * n + [False]
            if eos in new:  # nothing after an end-of-text token is kept
                cut = new.index(eos) + 1
                new, drafted, stop_reason = new[:cut], drafted[:cut], "eos"
            text.add(new, drafted)
            if text.stopped:
                new, stop_reason = new[: len(text.ids) - (len(tokens) - len(prompt))], "stop_string"
            tokens += new
            stats.new_tokens += len(new)
            yield from text.ready()
            if stop_reason in ("eos", "stop_string"):
                break
    finally:
        if outstanding:  # abandoned mid-step: roll the drafter back too
            drafter.accepted(0)
        cache.truncate(min(cache.length, len(tokens) - 1))
        stats.total_time = time.perf_counter() - start
    yield from text.ready(final=True)
    generated = tokens[len(prompt):]
    return Generation(text.text, generated, [p.drafted for p in text.pieces][: len(generated)], stop_reason, stats)
