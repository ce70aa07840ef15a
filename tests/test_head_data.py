"""The data of a head for a real target: instruction prompts, Debian documentation read as prose, the target's own
answers (resumable), and the weighted mixture with its draft vocabulary. No network: packages are stood in for by
folders laid out as dpkg-deb extracts them."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML

from tests.gguf_files import bpe_vocab, by_name, gguf_config, write_gguf
from verispec.checkpoints.chat_template import load_chat_template
from verispec.generate import generate
from verispec.models.native import load_model
from verispec.train.distill import answered, answers_file, distill
from verispec.train.head_data import conversations, frequent_tokens, mixture
from verispec.train.prompts import KINDS, build_prompts
from verispec.train.prose import documents, html_text, paragraphs, rst_text

pytestmark = pytest.mark.usefixtures("single_thread")


def test_prompts_are_reproducible_distinct_and_of_every_kind() -> None:
    prompts = build_prompts(400, seed=0, paragraphs=["A paragraph of prose. It has sentences. Three of them."])
    assert prompts == build_prompts(400, seed=0, paragraphs=["A paragraph of prose. It has sentences. Three of them."])
    assert prompts != build_prompts(400, seed=1)
    assert len({p.turns for p in prompts}) == 400 and [p.key for p in prompts] == [str(i) for i in range(400)]
    two = [p for p in prompts if len(p.turns) == 2]
    assert 0.1 < len(two) / len(prompts) < 0.3
    text = "\n".join(p.turns[0] for p in prompts)
    for marker in ("Translate", "Summarize", "Write a Python function", "story", "List "):
        assert marker in text
    assert len(KINDS) == 11


def test_documentation_packages_read_as_text(tmp_path) -> None:
    html = (
        "<html><head><style>p {}</style></head><body><h1>Title</h1><p>One  line\nwrapped.</p><script>x()</script>"
        "<p>Two.</p></body></html>"
    )
    assert html_text(html) == "Title\n\nOne line wrapped.\n\nTwo."
    assert rst_text("Use :func:`open` or :ref:`the guide <guide>`.\n.. note::\nText") == "Use open or the guide.\nText"
    fortunes = tmp_path / "fortunes" / "usr/share/games/fortunes"
    fortunes.mkdir(parents=True)
    (fortunes / "people").write_text("First saying.\n%\nSecond one,\n\t-- someone\n%\n")
    (fortunes / "people.dat").write_bytes(b"\0")
    assert list(documents(tmp_path / "fortunes")) == [
        ("fortunes/people/0", "First saying.\n\nSecond one,\n\t-- someone")
    ]
    reference = tmp_path / "debian-reference-en" / "usr/share/debian-reference"
    reference.mkdir(parents=True)
    text = "Preface\n\nChapter\u00a01.\u00a0Tutorials\n\nSome text.\n\nChapter\u00a02.\u00a0Packages\n\nMore."
    (reference / "debian-reference.en.txt.gz").write_bytes(gzip.compress(text.encode()))
    chapters = [t for _, t in documents(tmp_path / "debian-reference-en")]
    assert len(chapters) == 3 and chapters[2].startswith("Chapter\u00a02")
    prose = "This is a paragraph of ordinary prose. It says something. " * 8
    assert paragraphs([("doc", f"{prose}\n\nx = {{1: 2}}. Code here. More code. {prose}\n\nShort.")]) == [prose.strip()]


def test_a_mixture_gives_each_source_its_share() -> None:
    parts = {
        "a": np.arange(10, dtype=np.uint32),
        "b": np.arange(100, 1100, dtype=np.uint32),
        "c": np.zeros(0, dtype=np.uint32),
    }
    mixed = mixture(parts, {"a": 0.5, "b": 0.25, "c": 0.25}, 3000)
    assert len(mixed) == 3000 and (mixed < 10).sum() == 2000  # c is empty: a and b share everything, 2 to 1
    assert frequent_tokens(np.array([5, 5, 5, 2, 2, 9]), 12, 2).tolist() == [5, 2]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    path = write_gguf(
        tmp_path_factory.mktemp("chat") / "m.gguf", gguf_config(len(bpe_vocab()[0])), by_name({}, GGML.Q8_0)
    )
    return path, load_model(path, dtype="auto", exact=True)


def test_distillation_answers_each_prompt_once_and_resumes(chat_target, tmp_path) -> None:
    path, target = chat_target
    template = load_chat_template(path)
    prompts = build_prompts(4, seed=3)
    prompts[1] = type(prompts[1])(prompts[1].key, ("Hello?", "And then?"))  # a two-turn one
    distill(target, template, prompts[:3], tmp_path, 0, 1, max_new_tokens=6)
    file = answers_file(tmp_path, 0, 1)
    with file.open("a") as out:
        out.write('{"key": "9", "ids": [1, 2')  # a line cut short by a kill
    assert answered(file) == {"0", "1", "2"}
    distill(target, template, prompts, tmp_path, 0, 1, max_new_tokens=6)
    records = [json.loads(line) for line in file.read_text().splitlines()]  # the cut line gone
    assert [r["key"] for r in records] == ["0", "1", "2", "3"]
    two = records[1]
    assert len(two["answers"]) == 2
    rendered = template.render(
        [
            {"role": "user", "content": "Hello?"},
            {"role": "assistant", "content": two["answers"][0]},
            {"role": "user", "content": "And then?"},
        ]
    )
    prompt = target.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert two["ids"][: len(prompt)] == prompt and len(two["ids"]) > len(prompt)
    assert two["ids"][len(prompt) :] == generate(target, prompt, max_new_tokens=6).tokens  # plain greedy's answer
    assert sum(len(conversations(tmp_path, split)) for split in ("train", "validation", "benchmark")) == 4
