"""`verispec bench --suite` with Spec-Bench's question.jsonl: each turn through the target's chat template, a second
turn after the target's own plain greedy first answer, and a report with a column per category and the turns apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verispec import InvalidArgumentError, generate
from verispec.bench.harness import BenchOptions, quick_suite, run_bench
from verispec.bench.suite import read_suite
from verispec.checkpoints.chat_template import load_chat_template
from verispec.checkpoints.random_init import random_pair, tiny_config
from verispec.cli import main
from verispec.models.native import load_model
from verispec.spec_bench import MULTI_TURN, is_spec_bench, parsed, parses_as_python, turn_prompts

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now make it shorter."]},
    {"question_id": 82, "category": "writing", "turns": ["Name a colour.", "And another one?"]},
    {"question_id": 7, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 8, "category": "translation", "turns": ["Translate: bonjour le monde"]},
    {"question_id": 9, "category": "qa", "turns": ["x" * 300]},  # more than the context of 256 tokens
]
N = 8
LABELS = ["autoregressive", "ngram k=4", "suffix k=auto", "suffix k=8 tree_tokens=8"]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    target, _ = random_pair(tmp_path_factory.mktemp("spec"), tiny_config(num_hidden_layers=2))
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return target


def write_questions(folder: Path, questions: list[dict] = QUESTIONS) -> Path:
    path = folder / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return path


def test_each_turn_is_rendered_and_the_second_follows_the_first_answer(chat_target) -> None:
    target, render = load_model(chat_target), load_chat_template(chat_target).render
    items, skipped = turn_prompts(target, render, QUESTIONS, N)
    assert skipped == [9] and [item["id"] for item in items] == ["81/1", "81/2", "82/1", "82/2", "7/1", "8/1"]
    encode = lambda messages: target.tokenizer.encode(render(messages), add_special_tokens=False).ids
    first = [{"role": "user", "content": "Write a poem."}]
    answer = generate(target, encode(first), max_new_tokens=N)  # plain, greedy, stopping at EOS
    assert items[0]["prompt_ids"] == encode(first) and items[0]["max_new_tokens"] == len(answer.tokens)
    second = [
        *first,
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "Now make it shorter."},
    ]
    assert items[1]["prompt_ids"] == encode(second)
    assert [item["groups"] for item in items[:2]] == [
        [MULTI_TURN, f"{MULTI_TURN} turn 1"],
        [MULTI_TURN, f"{MULTI_TURN} turn 2"],
    ]
    assert items[4]["groups"] == [] and items[4]["category"] == "qa" and items[4]["turn"] == 1


def test_the_report_has_a_column_per_category_and_the_turns_apart(tmp_path, chat_target) -> None:
    suite = read_suite(write_questions(tmp_path))
    summary = run_bench(
        chat_target,
        None,
        tmp_path / "out",
        suite,
        BenchOptions(repeats=1, peers=False, progress=False, max_new_tokens=N, only=LABELS),
    )
    groups = {"all", "writing", "qa", "translation", MULTI_TURN, f"{MULTI_TURN} turn 1", f"{MULTI_TURN} turn 2"}
    assert set(summary) == set(LABELS) and all(set(entry) == groups for entry in summary.values())
    turns = summary["suffix k=auto"]
    assert turns[f"{MULTI_TURN} turn 2"]["prompts"] == 2 and turns["all"]["prompts"] == 6
    assert all(entry["all"]["exact_match"] == 1.0 for entry in summary.values())
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["info"]["spec_bench"] == {
        "questions": 5,
        "turns": 6,
        "max_new_tokens": N,
        "skipped": [9],
        "parses": {},
    }
    assert len(results["records"]) == 6 * len(LABELS)
    check = results["info"]["float64_check"]  # no draft: suffix decoding against plain decoding in float64
    assert check == {"method": "suffix k=auto", "prompts": 6, "exact_match": 1.0}
    report = (tmp_path / "out" / "report.md").read_text()
    table = report[report.index("## Speedup by category") : report.index("## All prompts")]
    header = (
        "| method | writing | qa | translation | multi-turn | multi-turn turn 1 | multi-turn turn 2 | overall "
        "| tau | acceptance |"
    )
    assert header in table and all(f"| {label} | " in table for label in LABELS)
    assert (
        "left out, a turn not fitting the context or answered by EOS at once: 9" in report
        and "## multi-turn turn 2" in report
    )


def test_a_target_without_a_chat_template_is_refused(tmp_path, pair_dirs, capsys) -> None:
    suite = read_suite(write_questions(tmp_path))
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        run_bench(
            pair_dirs[0],
            None,
            tmp_path / "out",
            suite,
            BenchOptions(repeats=1, peers=False, progress=False, max_new_tokens=N, only=LABELS[:1]),
        )
    code = main(
        [
            "bench",
            "--target",
            str(pair_dirs[0]),
            "--no-peers",
            "--suite",
            str(tmp_path / "question.jsonl"),
            "--methods",
            "autoregressive",
            "--out",
            str(tmp_path / "cli"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no chat template" in err
    given = "{% for m in messages %}<user>{{ m.content }}\n{% endfor %}<assistant>"  # --chat-template's, in its place
    summary = run_bench(
        pair_dirs[0],
        None,
        tmp_path / "given",
        suite,
        BenchOptions(repeats=1, peers=False, progress=False, max_new_tokens=N, only=LABELS[:1], chat_template=given),
    )
    assert list(summary) == LABELS[:1]
    with pytest.raises(InvalidArgumentError, match="Spec-Bench suite's turns"):  # prompts are rendered already
        run_bench(pair_dirs[0], None, tmp_path / "plain", quick_suite(), BenchOptions(chat_template=given))
    assert main(["bench", "--quick", "--chat-template", str(write_questions(tmp_path))]) == 2


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"question_id": 1, "category": "qa", "turns": ["q"]}', "not json"], "line 2 is not JSON"),
        (["[1, 2]"], "line 1 is not a JSON object"),
        (
            ['{"question_id": 1, "category": "qa", "turns": ["q"]}', '{"question_id": 2, "turns": ["q"]}'],
            "line 2: a Spec-Bench question needs",
        ),
        (['{"question_id": 1, "category": "qa", "turns": []}'], "line 1: a Spec-Bench question needs"),
        (['{"question_id": 1, "category": "qa", "turns": ["q"]}'] * 2, "line 2: question_id 1 again"),
    ],
)
def test_malformed_suites_are_refused(tmp_path, lines, message) -> None:
    path = tmp_path / "suite.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InvalidArgumentError, match=message):
        is_spec_bench(read_suite(path))


def test_a_coding_answer_is_checked_to_parse_as_python() -> None:
    assert parses_as_python("Here it is:\n```python\ndef f(x):\n    return x + 1\n```\nDone.")
    assert parses_as_python("```\ndef f(x):\n    return x\n```")  # a block without a language
    assert parses_as_python("def f(x):\n    return x\n")  # no block: the whole answer
    assert not parses_as_python("```python\ndef f(x):\n    return (x\n```")
    assert not parses_as_python("```python\ndef f(x):\n    if x:\n")  # cut off inside its block
    assert not parses_as_python("I cannot help with that.")


def test_coding_questions_note_whether_their_answers_parse(tmp_path, chat_target) -> None:
    """HumanEval's questions and the code edits of them (../shared/data's files, in Spec-Bench's format) are read
    as any Spec-Bench suite; each answer is checked, and the report says how many parse."""
    questions = [
        {
            "question_id": 0,
            "category": "humaneval",
            "task_id": "HumanEval/0",
            "turns": ["Complete the following Python function.\n\n```python\ndef f(x):\n```"],
        },
        {
            "question_id": 1,
            "category": "code-edit",
            "task_id": "HumanEval/0",
            "turns": ["Add a docstring.\n\n```python\ndef f(x):\n    return x\n```"],
        },
    ]
    suite = read_suite(write_questions(tmp_path, questions))
    target, render = load_model(chat_target), load_chat_template(chat_target).render
    items, _ = turn_prompts(target, render, suite, N)
    answers = [generate(target, item["prompt_ids"], max_new_tokens=N).text for item in items]
    assert [item["parses"] for item in items] == [parses_as_python(answer) for answer in answers]
    assert parsed(items) == {"humaneval": [int(items[0]["parses"]), 1], "code-edit": [int(items[1]["parses"]), 1]}
    run_bench(
        chat_target,
        None,
        tmp_path / "out",
        suite,
        BenchOptions(repeats=1, peers=False, progress=False, max_new_tokens=N, only=LABELS[:1]),
    )
    report = (tmp_path / "out" / "report.md").read_text()
    assert "parses as Python (the model's, the same for every method" in report
    assert f"humaneval {int(items[0]['parses'])} of 1; code-edit {int(items[1]['parses'])} of 1" in report
