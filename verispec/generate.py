"""The loop that joins drafter, target, acceptance rule and cache; plain decoding is the same loop with no drafter."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generator, Iterator, Sequence

import torch

from verispec.argument_checks import generation_args
from verispec.commit import commit_step
from verispec.constraint import Constraint
from verispec.detokenize import Piece, TextTracker
from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal, Verdict, check_target
from verispec.errors import DrafterError, InvalidArgumentError
from verispec.grammar import Grammar, TokenGrammar, bind, grammar_option
from verispec.models.protocol import CausalLM, SequenceCache
from verispec.sampling import SamplingParams, seeded_generator
from verispec.stats import GenerationStats
from verispec.step import speculative_step
from verispec.tree import cut_after_eos, depth


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


def stream(
    target: CausalLM,
    prompt: str | Sequence[int],
    drafter: Drafter | None = None,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    cache: SequenceCache | None = None,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    grammar: str | Grammar | TokenGrammar | None = None,
) -> Stream:
    """Speculative (or, with no drafter, plain autoregressive) decoding of one prompt, streamed.

    `cache`: the target's cache from an earlier generation, holding the first `cache.length` tokens of this prompt
    (a conversation's earlier turns, as `verispec.chat.Chat` keeps it), so that only the rest is prefilled; it
    holds every token but the last after this generation.

    At most one of `json_schema` (a dict or its JSON text), `regex` and `grammar` (Lark or GBNF text, or a `Grammar`)
    constrains the output: it is then exactly what the target decodes with the tokens the grammar forbids masked out
    at every position (greedy: their argmax; sampling: the masked, renormalised distribution), and ends with the
    end-of-sequence token once the grammar is complete."""
    sampling = SamplingParams(temperature, top_k, top_p)
    ids, max_new_tokens, seed, stop = generation_args(
        target, prompt, max_new_tokens=max_new_tokens, seed=seed, stop=stop
    )
    bound = bind(grammar_option(json_schema, regex, grammar), target, ignore_eos)
    generator = seeded_generator(target.device, seed)
    if drafter is not None:  # here, not in the loop, so that an incompatible drafter fails before any output
        check_target(drafter, target)
    eos = frozenset() if ignore_eos else target.eos_token_ids
    # The cache holds every token but the last, so prompt + max_new_tokens - 1 positions are all a chain
    # needs; a tree or side branch wider than it is deep needs up to width - 1 slots more while verified.
    width = 0 if drafter is None else drafter.width
    size = min(target.context_length, len(ids) + max_new_tokens) + max(0, width - 1)
    if cache is None:
        cache = target.new_cache(size)
    elif cache.length >= len(ids) or cache.max_len < size:
        raise InvalidArgumentError(
            f"the cache holds {cache.length} of {cache.max_len} positions; this prompt of "
            f"{len(ids)} tokens needs it to hold fewer, with room for {size}"
        )
    elif drafter is not None and drafter.needs.hidden_states:
        cache.truncate(0)  # the drafter reads the target's features of the whole prompt: prefill it all
    run = _Run(
        target,
        drafter,
        ids,
        sampling,
        generator,
        max_new_tokens,
        eos,
        cache,
        TextTracker(target.tokenizer, ids, stop),
        None if bound is None else bound.start(),
    )
    return Stream(_decode(run), run.stats)


def generate(target: CausalLM, prompt: str | Sequence[int], drafter: Drafter | None = None, **options) -> Generation:
    """Run `stream` to the end; same options."""
    steps = stream(target, prompt, drafter, **options)
    for _ in steps:
        pass
    return steps.result


@dataclass
class _Run:
    """One generation's fixed inputs and the state the loop keeps for it."""

    target: CausalLM
    drafter: Drafter | None
    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    max_new_tokens: int
    eos: frozenset[int]
    cache: SequenceCache
    text: TextTracker
    grammar: Constraint | None
    stats: GenerationStats = field(default_factory=GenerationStats)


def _begin(run: _Run) -> DraftSession | None:
    """Prefill the target with the prompt but its last token (past what its cache already holds), then start the
    drafter's session on it."""
    target, tokens = run.target, run.prompt
    layers = () if run.drafter is None else run.drafter.needs.hidden_states
    hidden = torch.empty(0, len(layers), target.hidden_size) if layers else None
    if len(tokens) - 1 > run.cache.length:  # its logits are not used: one row's LM head where the model can skip
        x = torch.tensor([tokens[run.cache.length : -1]], device=target.device)
        if layers:
            hidden = target(x, run.cache, hidden=layers, logits_to_keep=1)[1][0]
        else:
            target(x, run.cache, logits_to_keep=1)
    if run.drafter is None:
        return None
    return run.drafter.begin(
        DraftContext(target, list(tokens), run.sampling, run.generator, run.cache, hidden, run.grammar)
    )


def _decode(run: _Run) -> Generator[Piece, None, Generation]:
    """The loop's bookkeeping around `speculative_step`: room, proposals, the EOS cut, stats, stops and text."""
    target, drafter, cache, text, stats, eos = run.target, run.drafter, run.cache, run.text, run.stats, run.eos
    start, tokens, stop_reason = time.perf_counter(), list(run.prompt), "max_new_tokens"
    layers = () if drafter is None else drafter.needs.hidden_states
    try:
        session = _begin(run)
        stats.prefill_time = time.perf_counter() - start
        while True:
            room = min(run.max_new_tokens - (len(tokens) - len(run.prompt)), target.context_length - len(tokens))
            if room <= 0:
                done = len(tokens) - len(run.prompt) >= run.max_new_tokens
                stop_reason = "max_new_tokens" if done else "context_length"
                break
            t0 = time.perf_counter()
            proposal, asked = Proposal([]), session is not None and room > 1
            if asked:
                k = min(drafter.k, room - 1)
                proposal = session.propose(tokens, k)
                stats.drafter_calls += 1
                _check(drafter, proposal, k)
            proposal, kept = cut_after_eos(proposal, eos)
            t1 = time.perf_counter()
            step = speculative_step(
                target, cache, tokens[-1], proposal, run.sampling, run.generator, layers, run.grammar
            )
            if asked:
                session.accepted(Verdict([kept[i] for i in step.path], step.side_logits, step.hidden))
            stats.draft_time, stats.verify_time = (
                stats.draft_time + t1 - t0,
                stats.verify_time + time.perf_counter() - t1,
            )
            stats.target_calls += 1
            new = [*(proposal.tokens[i] for i in step.path), step.next_token]
            committed = commit_step(new, [True] * len(step.path) + [False], depth(proposal), eos, text, stats)
            tokens += committed.tokens
            yield from text.ready()
            if committed.stop_reason is not None:
                stop_reason = committed.stop_reason
                break
    finally:  # also when the stream is abandoned: the cache holds exactly the committed tokens but the last
        cache.truncate(min(cache.length, len(tokens) - 1))
        stats.total_time = time.perf_counter() - start
    yield from text.ready(final=True)
    generated = tokens[len(run.prompt) :]
    return Generation(text.text, generated, [p.drafted for p in text.pieces], stop_reason, stats)


def _check(drafter: Drafter, proposal: Proposal, k: int) -> None:
    """A proposal deeper than asked, or wider than the drafter declared, would overrun the cache or the context."""
    side = 0 if proposal.side is None else len(proposal.side.tokens)
    if depth(proposal) > k or len(proposal.tokens) + side > drafter.width:
        raise DrafterError(
            f"drafter {drafter.name} proposed {len(proposal.tokens) + side} tokens {depth(proposal)} "
            f"deep; it may propose at most {drafter.width} tokens {k} deep"
        )
