"""Measuring drafters on Spec-Bench questions for a head's card: every turn rendered with the target's chat template
(a second turn after the target's own first answer, as verispec/spec_bench.py does), each method asked for exactly the
target's plain greedy answer, plain decoding and the methods interleaved turn by turn (so that a busy machine slows
them alike), greedy.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from verispec.drafters.base import Drafter
from verispec.generate import generate
from verispec.models.protocol import CausalLM
from verispec.spec_bench import turn_prompts
from verispec.stats import GenerationStats


def first_of_each_category(questions: list[dict], per_category: int) -> list[dict]:
    """The first `per_category` questions of each category, in file order."""
    taken: dict[str, int] = defaultdict(int)
    out = []
    for question in questions:
        if taken[question["category"]] < per_category:
            taken[question["category"]] += 1
            out.append(question)
    return out


def _add(total: GenerationStats, s: GenerationStats) -> None:
    total.new_tokens += s.new_tokens
    total.target_calls += s.target_calls
    total.proposed += s.proposed
    total.accepted += s.accepted
    total.draft_time += s.draft_time
    total.total_time += s.total_time
    for i, (p, a) in enumerate(zip(s.proposed_by_position, s.accepted_by_position)):
        total.record_position(i, p, a)


def measure_questions(
    target: CausalLM,
    render: Callable[[list[dict]], str],
    questions: list[dict],
    drafters: dict[str, Drafter],
    max_new_tokens: int,
) -> dict:
    """Per method: tau, acceptance (overall and by position), identity with plain decoding on every turn, and its
    wall-clock speedup over plain decoding on the same turns; plus the turns measured."""
    items, skipped = turn_prompts(target, render, questions, max_new_tokens)
    totals = {name: GenerationStats() for name in ["plain", *drafters]}
    identical = {name: 0 for name in drafters}
    for item in items:
        options = dict(max_new_tokens=item["max_new_tokens"], ignore_eos=True)
        plain = generate(target, item["prompt_ids"], **options)
        _add(totals["plain"], plain.stats)
        for name, drafter in drafters.items():
            result = generate(target, item["prompt_ids"], drafter, **options)
            _add(totals[name], result.stats)
            identical[name] += result.tokens == plain.tokens
    plain_time = totals["plain"].total_time
    out = {"turns": len(items), "questions": len(questions) - len(skipped), "new_tokens": totals["plain"].new_tokens}
    for name in drafters:
        s = totals[name]
        out[name] = {
            "tau": s.tau,
            "acceptance_rate": s.acceptance_rate,
            "acceptance_by_position": s.acceptance_by_position,
            "identical_to_autoregressive": identical[name] / max(len(items), 1),
            "speedup": plain_time / s.total_time if s.total_time else 0.0,
        }
    return out
