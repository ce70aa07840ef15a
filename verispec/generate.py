"""The loop that joins drafter, target, acceptance rule and cache; plain decoding is the same loop with no drafter."""

from __future__ import annotations

import time
from dataclasses import dataclass
from numbers import Integral
from typing import Generator, Iterator, Sequence

import torch

from verispec.detokenize import Piece, TextTracker
from verispec.drafters.base import Drafter, Proposal, Verdict
from verispec.errors import ContextLengthError, DrafterError, InvalidArgumentError
from verispec.models.protocol import Cache, CausalLM
from verispec.sampling import SamplingParams
from verispec.stats import GenerationStats
from verispec.tree import cut_after_eos, depth, layout, through_eos, verify_tree
from verispec.verify import verify


@dataclass
class Generation:
    text: str
    tokens: list[int]  # the new tokens (an EOS that ended the generation included)
    drafted: list[bool]  # per new token: an accepted proposal (True) or the target's own token (False)
    stop_reason: str  # "eos", "stop_string", "max_new_tokens" or "context_length"
    stats: GenerationStats


class Stream:
    """Iterate for the text `Piece` of each token as soon as it is accepted; `result` is set at the end.

    `stats` counts as the stream goes, so a stream closed early (Ctrl-C) still has its partial numbers.
    """

    def __init__(self, steps: Generator[Piece, None, Generation], stats: GenerationStats) -> None:
        self._steps, self.stats, self.result = steps, stats, None

    def __iter__(self) -> Iterator[Piece]:
        result = yield from self._steps
        self.result = self.result if result is None else result  # iterating again yields nothing new

    def close(self) -> None:
        self._steps.close()


def stream(target: CausalLM, prompt: str | Sequence[int], drafter: Drafter | None = None, *,
           max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False) -> Stream:
    """Speculative (or, with no drafter, plain autoregressive) decoding of one prompt, streamed."""
    sampling = SamplingParams(temperature, top_k, top_p)
    # add_special_tokens lets the tokenizer's own post-processor add BOS where the model expects one.
    ids = target.tokenizer.encode(prompt, add_special_tokens=True).ids if isinstance(prompt, str) else list(prompt)
    stop = [stop] if isinstance(stop, str) else list(stop)
    if not ids:
        raise InvalidArgumentError("the prompt is empty")
    if len(ids) >= target.context_length:
        raise ContextLengthError(f"the prompt has {len(ids)} tokens; the context holds {target.context_length}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not all(isinstance(t, Integral) and 0 <= t < target.vocab_size for t in ids):
        raise InvalidArgumentError(f"prompt token ids must be integers in [0, {target.vocab_size})")
    ids = [int(t) for t in ids]
    if seed is not None and not (isinstance(seed, Integral) and 0 <= seed < 2**63):
        raise InvalidArgumentError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    generator = torch.Generator(target.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    eos = frozenset() if ignore_eos else target.eos_token_ids
    # The cache holds every token but the last, so prompt + max_new_tokens - 1 positions are all a chain
    # needs; a tree or side branch wider than it is deep needs up to width - 1 slots more while verified.
    width = 0 if drafter is None else drafter.width
    cache = target.new_cache(min(target.context_length, len(ids) + max_new_tokens) + max(0, width - 1))
    if drafter is not None:  # here, not in the loop, so that an incompatible drafter fails before any output
        drafter.begin(target, ids, sampling, generator, cache)
    text, stats = TextTracker(target.tokenizer, ids, stop), GenerationStats()
    return Stream(_decode(target, cache, ids, drafter, sampling, generator, max_new_tokens, eos, text, stats), stats)


def generate(target: CausalLM, prompt: str | Sequence[int], drafter: Drafter | None = None, **options) -> Generation:
    """Run `stream` to the end; same options."""
    steps = stream(target, prompt, drafter, **options)
    for _ in steps:
        pass
    return steps.result


def _decode(target: CausalLM, cache: Cache, prompt: list[int], drafter: Drafter | None, sampling: SamplingParams,
            generator: torch.Generator, max_new_tokens: int, eos: frozenset[int],
            text: TextTracker, stats: GenerationStats) -> Generator[Piece, None, Generation]:
    start, V = time.perf_counter(), target.vocab_size
    tokens = list(prompt)
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
                k = min(drafter.k, room - 1)
                proposal, outstanding = drafter.propose(tokens, k), True
                stats.drafter_calls += 1
                _check(drafter, proposal, k)
            proposal, kept = cut_after_eos(proposal, eos)
            t1 = time.perf_counter()
            # One forward: the last committed token, then the proposal (a chain or a tree), then any side branch.
            side = [] if proposal.side is None else proposal.side.tokens
            mask, positions = layout(proposal, cache.length, target.device)
            x = torch.tensor([[tokens[-1], *proposal.tokens, *side]], device=target.device)
            logits = target(x, cache, mask, positions)[0, :, :V]
            nodes = 1 + len(proposal.tokens)
            if proposal.parents is None:
                n, nxt = verify(proposal.tokens, proposal.probs, logits[None, :nodes], sampling, generator)
                path = list(range(n))
                cache.truncate(len(tokens) + n)  # the old last token and the accepted drafts; nxt is the new last
            else:
                path, nxt = verify_tree(proposal, logits[:nodes], sampling, generator)
                cache.keep(len(tokens), path)  # the accepted branch moves into place; the rest is dropped
            if outstanding:
                drafter.accepted(Verdict([kept[i] for i in path], logits[nodes:] if side else None))
                outstanding = False
            stats.draft_time, stats.verify_time = stats.draft_time + t1 - t0, stats.verify_time + time.perf_counter() - t1
            stats.target_calls += 1
            stats.record_step(depth(proposal), len(path))
            new, drafted = [*(proposal.tokens[i] for i in path), nxt], [True] * len(path) + [False]
            cut = through_eos(new, eos)  # nothing after an end-of-sequence token is kept
            if new[cut - 1] in eos:
                new, drafted, stop_reason = new[:cut], drafted[:cut], "eos"
            new = new[: text.add(new, drafted)]
            if text.stopped:
                stop_reason = "stop_string"
            tokens += new
            stats.new_tokens += len(new)
            yield from text.ready()
            if stop_reason in ("eos", "stop_string"):
                break
    finally:
        if outstanding:  # abandoned mid-step: roll the drafter back too
            drafter.accepted(Verdict([]))
        cache.truncate(min(cache.length, len(tokens) - 1))
        stats.total_time = time.perf_counter() - start
    yield from text.ready(final=True)
    generated = tokens[len(prompt):]
    return Generation(text.text, generated, [p.drafted for p in text.pieces], stop_reason, stats)


def _check(drafter: Drafter, proposal: Proposal, k: int) -> None:
    """A proposal deeper than asked, or wider than the drafter declared, would overrun the cache or the context."""
    side = 0 if proposal.side is None else len(proposal.side.tokens)
    if depth(proposal) > k or len(proposal.tokens) + side > drafter.width:
        raise DrafterError(f"drafter {drafter.name} proposed {len(proposal.tokens) + side} tokens {depth(proposal)} "
                           f"deep; it may propose at most {drafter.width} tokens {k} deep")
