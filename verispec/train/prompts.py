"""Instruction prompts for self-distillation: templates x topics (data/distill_topics.json), written for the purpose.

An EAGLE head learns to predict what the target says, so its best data is the target's own answers to the kind of
requests it will serve: explanations, how-tos, summaries of and questions about a given paragraph, rewriting, short
stories and poems, lists, simple math word problems, translation, small programs, and two-turn conversations (a
follow-up asked after the target's first answer). Paragraphs come from the hand-written ones and, when given, from
the prose corpus's train split. Everything is drawn from one seeded generator, so a prompt set is reproducible.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TOPICS = Path(__file__).resolve().parents[2] / "data" / "distill_topics.json"

EXPLAIN = (
    "Explain {c} in simple terms.",
    "What is {c}?",
    "How does {c} work?",
    "Why is {c} important?",
    "Write a short paragraph about {c}.",
    "What are three interesting facts about {c}?",
    "Describe {c} to someone who has never heard of it.",
    "What are the pros and cons of {c}?",
    "Can you tell me the history of {c}?",
    "What is the difference between {c} and {d}?",
)
HOWTO = (
    "How do I {t}?",
    "Give me step-by-step instructions to {t}.",
    "What is the best way to {t}?",
    "I want to {t}. Where should I start?",
    "What are some tips to {t}?",
    "Explain how to {t} in five steps.",
)
STORY = (
    "Write a short story about {ch} who {s}.",
    "Tell me a bedtime story about {ch}.",
    "Write a poem about {c}.",
    "Write the opening paragraph of a story about {ch} who {s}.",
    "Write a funny story about {ch}.",
    "Write a haiku about {c}.",
    "Write a letter from {ch} to a friend.",
)
LISTS = (
    "List {n} {li}.",
    "Give me {n} {li}, with one sentence about each.",
    "What are some {li}?",
    "Name {n} {li} and explain why each one matters.",
)
ENTITY = (
    "Tell me about {e}.",
    "What is {e} famous for?",
    "Write a short description of {e}.",
    "What are some facts about {e}?",
    "Why is {e} important in history?",
    "Who or what is {e}?",
)
REWRITE = (
    "Rewrite the following sentence {style}: {sent}",
    "Correct the grammar and spelling: {sent}",
    "Paraphrase this sentence: {sent}",
    "Rewrite this text {style}:\n\n{p}",
)
SUMMARY = (
    "Summarize the following text in two sentences:\n\n{p}",
    "Summarize this article:\n\n{p}",
    "Write a one-sentence summary of the following paragraph.\n\n{p}",
    "What is the main point of this text?\n\n{p}",
    "Give a short title and a summary for this text:\n\n{p}",
    "Summarize the key points as a bulleted list:\n\n{p}",
)
QUESTION = (
    "Read the text and answer the question.\n\nText: {p}\n\nQuestion: {q}",
    "{p}\n\n{q}",
    "Based on the following passage, {q_lower}\n\n{p}",
)
TEXT_QUESTIONS = (
    "What is the text about?",
    "Who is mentioned in the text?",
    "What happened, according to the text?",
    "What might happen next?",
    "What is one important fact from the text?",
    "Why is this information useful?",
    "What questions does the text leave unanswered?",
)
TRANSLATE = (
    "Translate the following {lang} sentence into English: {s}",
    "Translate to English: {s}",
    'What does "{s}" mean in English?',
)
TRANSLATE_TO = ("Translate into {lang}: {en}", 'How do you say "{en}" in {lang}?')
CODE_TASKS = (
    "checks whether a number is prime",
    "counts the words in a string",
    "computes the factorial of a number",
    "returns the largest number in a list",
    "converts Celsius to Fahrenheit",
    "removes duplicates from a list",
    "checks if a string is a palindrome",
    "merges two dictionaries",
    "computes the average of a list",
    "reverses the words in a sentence",
    "finds the second smallest number in a list",
    "counts how often each letter appears in a string",
    "returns the Fibonacci numbers below n",
)
CODE = (
    "Write a Python function that {task}.",
    "How would I write a program that {task}?",
    "Write a Python function that {task}, and explain how it works.",
)
NAMES = (
    "Anna",
    "Ben",
    "Carlos",
    "Divya",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jack",
    "Lena",
    "Omar",
    "Sara",
    "Tom",
)
ITEMS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "stamps", "cards", "eggs", "oranges")

# How often each kind of prompt is drawn (relative weights)
KINDS = {
    "explain": 16,
    "howto": 10,
    "story": 7,
    "list": 7,
    "entity": 8,
    "rewrite": 6,
    "summary": 10,
    "question": 8,
    "math": 10,
    "translate": 7,
    "code": 5,
}
MULTI_TURN = 0.2  # the share of prompts that get a second, follow-up turn


@dataclass(frozen=True)
class Prompt:
    """A conversation's user turns: the first is answered, then the next asked after that answer."""

    key: str  # stable identity (its position in the drawn set), where answers are stored by it
    turns: tuple[str, ...]


def _math(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(5, 60), rng.randint(2, 30), rng.randint(1, 9)
    problems = (
        f"{name} has {a} {item}. {name} buys {b} more and gives {c} to a friend. How many {item} are left?",
        f"A train travels at {a + 40} km per hour for {c} hours. How far does it travel?",
        f"A shirt costs ${a + 10}. It is on sale for {rng.choice((10, 20, 25, 50))}% off. What is the sale price?",
        f"There are {a + b} students in a class and {b} of them are boys. How many girls are there?",
        f"{name} saves ${c + 1} every week. How much will {name} have saved after {b} weeks?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"If {c + 1} workers can paint a house in {b * (c + 1)} hours, how long would one worker take?",
        f"What is {a} times {b} plus {c}?",
        f"{name} reads {b} pages a day. The book has {a * 10} pages. How many days will it take to finish it?",
        f"A box holds {c + 2} {item}. How many boxes are needed for {a * (c + 2) + 1} {item}?",
        f"The temperature was {c} degrees in the morning and rose by {b} degrees. Then it fell by {c + 3}. "
        f"What is the temperature now?",
        f"{name} is {b} years old. Their mother is {a % 20 + 22} years older. How old will the mother be in {c} years?",
    )
    return rng.choice(problems) + rng.choice(("", "", " Solve it step by step.", " Explain your reasoning."))


def _first_turn(kind: str, rng: random.Random, topics: dict, paragraphs: list[str]) -> str:
    pick = rng.choice
    concepts = topics["concepts"]
    if kind == "explain":
        return pick(EXPLAIN).format(c=pick(concepts), d=pick(concepts))
    if kind == "howto":
        return pick(HOWTO).format(t=pick(topics["tasks"]))
    if kind == "story":
        return pick(STORY).format(ch=pick(topics["characters"]), s=pick(topics["situations"]), c=pick(concepts))
    if kind == "list":
        return pick(LISTS).format(n=rng.randint(3, 10), li=pick(topics["list_items"]))
    if kind == "entity":
        return pick(ENTITY).format(e=pick(topics["entities"]))
    if kind == "rewrite":
        return pick(REWRITE).format(
            style=pick(topics["rewrite_styles"]), sent=pick(topics["sentences"]), p=pick(paragraphs)
        )
    if kind == "summary":
        return pick(SUMMARY).format(p=pick(paragraphs))
    if kind == "question":
        q = pick(TEXT_QUESTIONS)
        return pick(QUESTION).format(p=pick(paragraphs), q=q, q_lower=q[0].lower() + q[1:])
    if kind == "math":
        return _math(rng)
    if kind == "translate":
        if rng.random() < 0.3:
            return pick(TRANSLATE_TO).format(
                lang=pick(sorted(topics["foreign"])), en=pick(topics["english_to_translate"])
            )
        lang = pick(sorted(topics["foreign"]))
        return pick(TRANSLATE).format(lang=lang, s=pick(topics["foreign"][lang]))
    if kind == "code":
        return pick(CODE).format(task=pick(CODE_TASKS))
    raise ValueError(f"unknown prompt kind {kind!r}")


def build_prompts(count: int, seed: int = 0, paragraphs: list[str] = (), topics_file: Path = TOPICS) -> list[Prompt]:
    """`count` distinct prompts, drawn by kind (KINDS), a share of them with a follow-up turn; `paragraphs` (e.g.
    from the prose corpus's train split) join the hand-written ones for summaries, rewriting and questions."""
    topics = json.loads(topics_file.read_text())
    paragraphs = [*topics["paragraphs"], *paragraphs]
    rng, kinds = random.Random(seed), list(KINDS)
    weights = [KINDS[k] for k in kinds]
    seen, prompts = set(), []
    for _ in range(count * 20):  # a bound: small topic lists can run out of new combinations
        if len(prompts) == count:
            break
        first = _first_turn(rng.choices(kinds, weights)[0], rng, topics, paragraphs)
        turns = (first, rng.choice(topics["followups"])) if rng.random() < MULTI_TURN else (first,)
        if turns not in seen:
            seen.add(turns)
            prompts.append(Prompt(str(len(prompts)), turns))
    return prompts
