"""The benchmark suite: categories, cut points, and prompts only from files no model trained on."""

from __future__ import annotations

import json

import pytest

from verispec.bench.suite import CATEGORIES, SUITE, _cut_points, _shingle_overlap, build_suite, read_suite
from verispec.errors import InvalidArgumentError
from verispec.train.corpus import MANIFEST, read_manifest

BODY = "".join(f"def helper_{i}(value):\n    total = value * {i}\n    return total + {i}\n\n" for i in range(12))
SOURCE = (
    '"""Module docstring."""\n\nimport os\n\n'
    + BODY
    + 'def documented(x):\n    """Double x."""\n    return 2 * x\n\n'
    + BODY
)


def test_cut_points_match_their_category() -> None:
    code = _cut_points(SOURCE, "code")
    assert code and all(SOURCE[p - 1] == "\n" and SOURCE[:p].splitlines()[-1].startswith("    ") for p in code)
    assert any(SOURCE[:p].endswith('"""Double x."""\n') for p in _cut_points(SOURCE, "docstring"))
    repeated = _cut_points(SOURCE, "repetition")
    assert repeated and all(_shingle_overlap(SOURCE[:p], SOURCE[p : p + 300]) >= 0.6 for p in repeated)


def test_build_suite_is_deterministic_line_aligned_and_one_prompt_per_file() -> None:
    files = [(f"pkg/m{i}.py", f"# file {i}\n" + SOURCE) for i in range(12)]
    suite = build_suite(files, per_category=3, max_new_tokens=32)
    assert suite == build_suite(files, per_category=3, max_new_tokens=32)
    assert [item["category"] for item in suite] == [c for c in CATEGORIES for _ in range(3)]
    assert len({item["source"] for item in suite}) == len(suite)  # categories share no file
    for item in suite:
        text = dict(files)[item["source"]]
        start = text.index(item["prompt"])
        assert (start == 0 or text[start - 1] == "\n") and item["prompt"].endswith("\n")
        assert item["max_new_tokens"] == 32


def test_committed_suite_comes_from_the_benchmark_split() -> None:
    suite = read_suite(SUITE)
    benchmark = {e.path for e in read_manifest(MANIFEST) if e.split == "benchmark"}
    assert len(suite) >= 40 and {item["category"] for item in suite} == set(CATEGORIES)
    assert all(item["source"] in benchmark for item in suite)
    assert all(set(item) == {"id", "category", "source", "prompt", "max_new_tokens"} for item in suite)
    assert len({item["id"] for item in suite}) == len(suite) and all(item["prompt"].strip() for item in suite)


def test_per_category_keeps_the_first_of_each_category_in_order(tmp_path) -> None:
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"q{i}"]} for i in range(7)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    assert [item["question_id"] for item in read_suite(path, 2)] == [0, 1, 2, 3]
    assert len(read_suite(path)) == 7
    with pytest.raises(InvalidArgumentError, match="--per-category must be >= 1"):
        read_suite(path, 0)
