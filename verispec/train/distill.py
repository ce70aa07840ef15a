"""Self-distillation data: the target's own greedy answers to the instruction prompts of `prompts.py`, rendered with
its chat template and stored as token ids, one JSON line per conversation (resumable: a prompt already answered is
skipped, so a killed or paused run goes on where it stopped).

Answers are decoded greedily by verispec itself with prompt lookup drafting, which is lossless: the tokens are the
target's plain greedy decoding. A two-turn prompt is answered turn by turn, the second turn asked after the first
answer, as a person would chat.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from verispec.checkpoints.chat_template import ChatTemplate
from verispec.drafters.ngram import PromptLookup
from verispec.generate import generate
from verispec.models.protocol import CausalLM
from verispec.train.prompts import Prompt


def answers_file(folder: Path, shard: int, shards: int) -> Path:
    return folder / f"answers-{shard}-of-{shards}.jsonl"


def answered(file: Path) -> set[str]:
    """The keys already answered in a shard's file (a line cut short by a kill is ignored, and answered again)."""
    if not file.is_file():
        return set()
    keys = set()
    for line in file.read_text().splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (ValueError, KeyError):
            continue
    return keys


def _drop_partial_line(file: Path) -> None:
    """Cut a last line that a kill left without its newline, so that the next answer starts a line of its own."""
    if not file.is_file():
        return
    data = file.read_bytes()
    if data and not data.endswith(b"\n"):
        file.write_bytes(data[: data.rfind(b"\n") + 1])


def conversation(target: CausalLM, template: ChatTemplate, prompt: Prompt, max_new_tokens: int) -> dict:
    """The conversation of one prompt, each user turn answered greedily: its turns, answers and token ids (the
    rendered conversation up to the last answer, which is followed by the end-of-turn token where it ended)."""
    messages, answers = [], []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        ids = target.tokenizer.encode(template.render(messages), add_special_tokens=False).ids
        result = generate(target, ids, PromptLookup(4), max_new_tokens=max_new_tokens)
        answers.append(result.text)
        messages.append({"role": "assistant", "content": result.text})
    return {
        "key": prompt.key,
        "turns": list(prompt.turns),
        "answers": answers,
        "stop": result.stop_reason,
        "ids": ids + result.tokens,
    }


def distill(
    target: CausalLM,
    template: ChatTemplate,
    prompts: list[Prompt],
    folder: Path,
    shard: int = 0,
    shards: int = 1,
    max_new_tokens: int = 320,
) -> Path:
    """Answer this shard's prompts (every `shards`-th from `shard`) not yet in its file, appending one line each."""
    folder.mkdir(parents=True, exist_ok=True)
    file = answers_file(folder, shard, shards)
    _drop_partial_line(file)
    done, start, tokens = answered(file), time.perf_counter(), 0
    todo = [p for i, p in enumerate(prompts) if i % shards == shard and p.key not in done]
    for n, prompt in enumerate(todo, 1):
        record = conversation(target, template, prompt, max_new_tokens)
        with file.open("a") as out:
            out.write(json.dumps(record) + "\n")
        tokens += len(record["ids"])
        if n % 20 == 0 or n == len(todo):
            print(
                f"shard {shard}: {n}/{len(todo)} answered, {tokens / (time.perf_counter() - start):.0f} tokens/s",
                flush=True,
            )
    return file
