"""Spec-Bench (Xia et al. 2024) as prompts: its question.jsonl, one question a line with `question_id`, `category` and
`turns` (the user's messages; MT-bench's questions have two). The bench runs them as a suite (bench/harness.py) and
training measures its heads on them (train/question_measure.py), so they live below both.

Each turn is one prompt of the suite, rendered by the target's chat template. As in Spec-Bench's own inference, a
second turn follows the model's own first answer: the conversation is the first question, the answer the target gives
it, and the second question. That answer is the target's greedy one, the same for every lossless method, so it is
decoded once here, plainly, and reused by all. Spec-Bench stops each answer at the end of its turn: here every turn
is first decoded plainly, greedily, to its end (EOS) or `max_new_tokens`, and each method is then asked for exactly
that many tokens (the bench ignores EOS, so every method writes the same answer and nothing past it).

A coding question (`CODE_CATEGORIES`: HumanEval's, and the code edits of it) asks for a function in one code block:
whether the target's answer parses as Python is noted beside the speed. The answers are the target's own, so this
measures the model, not the method; what it catches is a broken prompt (a wrong chat template gets no code back).
"""

from __future__ import annotations

import ast
import re
from typing import Callable

from verispec.errors import InvalidArgumentError
from verispec.generate import Generation, generate
from verispec.models.protocol import CausalLM

Render = Callable[[list[dict[str, str]]], str]  # messages -> the prompt text, ending where the reply begins
MAX_NEW_TOKENS = 1024  # Spec-Bench's own limit per turn
MULTI_TURN = "multi-turn"  # the report's groups over the questions with two turns (MT-bench's categories)
CODE_CATEGORIES = ("humaneval", "code-edit")  # questions whose answer is a Python function in a code block
FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def parses_as_python(answer: str) -> bool:
    """Whether the answer's first code block (without one, the whole answer) is a valid Python module."""
    block = FENCE.search(answer)
    try:
        ast.parse(block.group(1) if block else answer)
    except (SyntaxError, ValueError):
        return False
    return True


def is_spec_bench(items: list[dict]) -> bool:
    """Whether a suite's lines are Spec-Bench questions (any line with `turns`): each is then checked."""
    if not any("turns" in item for item in items):
        return False
    seen = set()
    for number, item in enumerate(items, 1):
        turns = item.get("turns")
        if (
            "question_id" not in item
            or not isinstance(item.get("category"), str)
            or not isinstance(turns, list)
            or not turns
            or not all(isinstance(turn, str) and turn for turn in turns)
        ):
            raise InvalidArgumentError(
                f"suite line {number}: a Spec-Bench question needs question_id, a category "
                "and turns (a list of non-empty strings)"
            )
        if str(item["question_id"]) in seen:  # (its turns' results are kept by it)
            raise InvalidArgumentError(f"suite line {number}: question_id {item['question_id']} again")
        seen.add(str(item["question_id"]))
    return True


def turn_prompts(
    target: CausalLM, render: Render | None, questions: list[dict], max_new_tokens: int = MAX_NEW_TOKENS
) -> tuple[list[dict], list]:
    """The suite's items, a turn each (id "QUESTION/TURN", the token ids of the rendered conversation in
    `prompt_ids`, `max_new_tokens` the length of the target's plain greedy answer), and the ids of the questions
    left out because a turn does not fit the context or has an empty answer."""
    if render is None:
        raise InvalidArgumentError(
            f"{target.name} has no chat template: a Spec-Bench suite is a set of chat "
            "questions, rendered by the target's own template"
        )
    items, skipped = [], []
    for question in questions:
        turns = _answered(target, render, question, max_new_tokens)
        if turns is None:
            skipped.append(question["question_id"])
            continue
        two = len(question["turns"]) > 1
        for turn, (ids, answer) in enumerate(turns, 1):
            groups = [MULTI_TURN, f"{MULTI_TURN} turn {turn}"] if two else []
            code = {"parses": parses_as_python(answer.text)} if question["category"] in CODE_CATEGORIES else {}
            items.append(
                {
                    "id": f"{question['question_id']}/{turn}",
                    "category": question["category"],
                    "turn": turn,
                    "groups": groups,
                    "prompt_ids": ids,
                    "max_new_tokens": len(answer.tokens),
                }
                | code
            )
    return items, skipped


def parsed(items: list[dict]) -> dict[str, list[int]]:
    """By coding category: how many of its answers parse as Python, of how many."""
    counts: dict[str, list[int]] = {}
    for item in items:
        if "parses" in item:
            count = counts.setdefault(item["category"], [0, 0])
            count[0] += item["parses"]
            count[1] += 1
    return counts


def _answered(
    target: CausalLM, render: Render, question: dict, max_new_tokens: int
) -> list[tuple[list[int], Generation]] | None:
    """(prompt ids, the plain greedy answer) per turn, each turn after the earlier ones and their answers; None if a
    turn leaves no room in the context for its answer, or is answered by EOS at once."""
    messages, out = [], []
    for text in question["turns"]:
        messages.append({"role": "user", "content": text})
        ids = target.tokenizer.encode(render(messages), add_special_tokens=False).ids
        room = min(max_new_tokens, target.context_length - len(ids))
        if room < 1:
            return None
        answer = generate(target, ids, max_new_tokens=room)
        if not answer.tokens:  # EOS at once: no answer to time
            return None
        out.append((ids, answer))
        messages.append({"role": "assistant", "content": answer.text})
    return out
