"""The benchmark suite: prompts cut from the benchmark split of the corpus, in three categories.

code        cut inside a function or method body, at the end of a line
docstring   cut right after a docstring, where the code it describes begins
repetition  cut before a line whose continuation largely stands in the prompt already (a test method
            whose twin is above, a table, a run of similar calls)
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from verispec.errors import InvalidArgumentError
from verispec.train.corpus import MANIFEST, load_files

CATEGORIES = ("code", "docstring", "repetition")
SUITE = Path(__file__).resolve().parents[2] / "data" / "bench" / "suite.jsonl"
CONTEXT_CHARS = 1000  # short enough that the prompt and 128 new tokens fit the shipped target's 512-token context


def _shingle_overlap(prompt: str, continuation: str, size: int = 8) -> float:
    """Share of the continuation's character 8-grams that already occur in the prompt."""
    grams = [continuation[i : i + size] for i in range(max(1, len(continuation) - size + 1))]
    return sum(g in prompt for g in grams) / len(grams)


def _is_code(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith(("#", '"', "'"))


def _cut_points(text: str, category: str) -> list[int]:
    """Offsets (line starts) where a prompt of this category may end."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    points = []
    for i, line in enumerate(lines[:-4]):
        body = re.match(r"( {4,})\S", line) and not line.lstrip().startswith(("#", '"', "'"))
        if category == "code" and body and _is_code(lines[i + 1]):
            points.append(starts[i + 1])
        elif category == "docstring" and line.rstrip().endswith(('"""', "'''")) and _is_code(lines[i + 1]):
            points.append(starts[i + 1])
        elif category == "repetition" and re.match(r"\s*(def |[\w.]+\(|\(|\[|\{)", lines[i + 1]):
            prompt, continuation = (
                text[max(0, starts[i + 1] - CONTEXT_CHARS) : starts[i + 1]],
                text[starts[i + 1] : starts[i + 1] + 300],
            )
            if len(continuation) > 200 and _shingle_overlap(prompt, continuation) >= 0.6:
                points.append(starts[i + 1])
    return [p for p in points if p >= CONTEXT_CHARS // 2]


def build_suite(
    files: list[tuple[str, str]], per_category: int = 14, max_new_tokens: int = 128, seed: int = 0
) -> list[dict]:
    """Files in a seeded random order; each file gives at most one prompt in all, so categories share no text."""
    rng, suite, used = random.Random(seed), [], set()
    order = rng.sample(files, len(files))
    for category in reversed(CATEGORIES):  # the rarest cut points choose their files first
        chosen = 0
        for path, text in order:
            if chosen == per_category or path in used or not (points := _cut_points(text, category)):
                continue
            used.add(path)
            end = rng.choice(points)
            start = text.find("\n", max(0, end - CONTEXT_CHARS)) + 1  # begin on a line boundary
            suite.append(
                {
                    "id": f"{category}-{chosen:02d}",
                    "category": category,
                    "source": path,
                    "prompt": text[start:end],
                    "max_new_tokens": max_new_tokens,
                }
            )
            chosen += 1
    return sorted(suite, key=lambda item: (CATEGORIES.index(item["category"]), item["id"]))


def write_suite(suite: list[dict], path: Path = SUITE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(item) + "\n" for item in suite))


def read_suite(path: Path = SUITE, per_category: int | None = None) -> list[dict]:
    """A suite's lines, each a JSON object: this suite's items, or Spec-Bench's questions (verispec/spec_bench.py);
    `per_category`: only the first that many of each category, in the file's order."""
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as err:
            raise InvalidArgumentError(f"{path}: line {number} is not JSON ({err})") from None
        if not isinstance(item, dict):
            raise InvalidArgumentError(f"{path}: line {number} is not a JSON object")
        items.append(item)
    if not items:
        raise InvalidArgumentError(f"{path}: no prompts")
    if per_category is not None:
        if per_category < 1:
            raise InvalidArgumentError(f"--per-category must be >= 1, got {per_category}")
        seen: dict[str, int] = {}
        kept = []
        for item in items:
            category = str(item.get("category"))
            seen[category] = seen.get(category, 0) + 1
            if seen[category] <= per_category:
                kept.append(item)
        items = kept
    return items


def check_items(items: list[dict]) -> None:
    """This suite's format: every item has an id, a category, a prompt and a max_new_tokens."""
    for number, item in enumerate(items, 1):
        missing = [key for key in ("id", "category", "prompt", "max_new_tokens") if key not in item]
        if missing:
            raise InvalidArgumentError(
                f"suite line {number} lacks {', '.join(missing)} (a prompt suite's line has "
                "id, category, prompt and max_new_tokens; a Spec-Bench question's "
                "question_id, category and turns)"
            )


def build_from_manifest(manifest: Path = MANIFEST) -> list[dict]:
    """The suite from the benchmark split: files that no model saw in training."""
    files, skipped = load_files("benchmark", manifest)
    if skipped:
        print(f"benchmark split: {skipped} files missing or changed since the manifest were skipped")
    return build_suite(files)


if __name__ == "__main__":
    write_suite(build_from_manifest())
    print(f"wrote {SUITE}")
