"""Chat: a conversation through the checkpoint's chat template with the target's cache kept across turns
(`verispec.chat.Chat`), `verispec generate --chat`, and `verispec chat` on a real terminal (a pseudo-terminal)."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import gguf
import pytest

from gguf_files import bpe_vocab, gguf_config, write_gguf
from verispec import DraftModel, InvalidArgumentError, generate, load_model
from verispec.chat import Chat
from verispec.checkpoints import gguf_tokenizer
from verispec.checkpoints.chat_template import load_chat_template
from verispec.checkpoints.random_init import random_pair, tiny_config
from verispec.cli import main
from verispec.cli.output import GREEN
from verispec.serve.app import serving_app

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
N = 10


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target, draft = random_pair(tmp_path_factory.mktemp("chat"), tiny_config(num_hidden_layers=2))
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return target, draft


def _alone(target, messages: list[dict], drafter=None) -> str:
    """The reply `generate` gives the whole conversation rendered and prefilled from scratch."""
    text = load_chat_template(target_dir(target)).render(messages)
    ids = target.tokenizer.encode(text, add_special_tokens=False).ids
    return generate(target, ids, drafter, max_new_tokens=N, ignore_eos=True).text


def target_dir(target) -> Path:
    return Path(target.module_dir)


class _Counting:
    """The target, counting the tokens each forward is given."""

    def __init__(self, target) -> None:
        self._target, self.widths = target, []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, tokens, *args, **kwargs):
        self.widths.append(tokens.shape[1])
        return self._target(tokens, *args, **kwargs)


@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "draft"])
def test_turns_reuse_the_cache_and_reply_as_a_fresh_prefill_would(chat_pair, with_draft: bool) -> None:
    target = load_model(chat_pair[0])
    target.module_dir = chat_pair[0]
    drafter = DraftModel(load_model(chat_pair[1]), 3) if with_draft else None
    counting = _Counting(target)
    render = load_chat_template(chat_pair[0]).render
    chat = Chat(counting, render, drafter, system="Be brief.", max_new_tokens=N, ignore_eos=True)
    history = [{"role": "system", "content": "Be brief."}]
    for turn, message in enumerate(["Write a loop.", "And a function?", "Thanks"]):
        before = chat.cache.length
        counting.widths.clear()
        reply = "".join(piece.text for piece in chat.say(message))
        history += [{"role": "user", "content": message}]
        assert reply == _alone(target, history, drafter)
        history += [{"role": "assistant", "content": reply}]
        assert chat.messages == history
        ids = target.tokenizer.encode(render(history[:-1]), add_special_tokens=False).ids
        if turn:  # only what the cache lacked was prefilled
            assert before > 0 and counting.widths[0] < len(ids) - 1
    chat.reset()
    assert chat.cache.length == 0 and chat.messages == history[:1]
    assert "".join(p.text for p in chat.say("Write a loop.")) == _alone(target, history[:2], drafter)


def test_a_closed_reply_joins_the_conversation(chat_pair) -> None:
    target = load_model(chat_pair[0])
    chat = Chat(target, load_chat_template(chat_pair[0]).render, max_new_tokens=N, ignore_eos=True)
    steps = chat.say("hello")
    first = next(iter(steps)).text
    steps.close()
    assert chat.messages[-1] == {"role": "assistant", "content": first}
    assert chat.cache.length <= len(chat._cached)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        chat.say("")


def test_generate_chat_puts_the_message_through_the_template(chat_pair, capsys) -> None:
    target_path = str(chat_pair[0])
    target = load_model(chat_pair[0])
    target.module_dir = chat_pair[0]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi there"}]
    code = main(
        [
            "generate",
            "--chat",
            "hi there",
            "--system",
            "sys",
            "--target",
            target_path,
            "--max-new-tokens",
            str(N),
            "--ignore-eos",
            "--color",
            "never",
            "--threads",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(_alone(target, messages) + "\n\n")
    assert main(["generate", "hi", "--system", "sys", "--target", target_path]) == 2
    assert "--system goes with --chat" in capsys.readouterr().err


def test_chat_refuses_a_checkpoint_without_a_template(pair_dirs, capsys) -> None:
    assert main(["chat", "--target", str(pair_dirs[0])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error:") and err.count("\n") == 1 and "no chat template" in err
    assert main(["generate", "--chat", "hi", "--target", str(pair_dirs[0])]) == 2


def _read_until(fd: int, text: str, seconds: float = 120) -> str:
    out, deadline = b"", time.monotonic() + seconds
    while text.encode() not in out:
        assert time.monotonic() < deadline, out.decode(errors="replace")
        if select.select([fd], [], [], 0.5)[0]:
            try:
                out += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
    return out.decode(errors="replace")


def test_chat_on_a_terminal(chat_pair) -> None:
    """`verispec chat` on a pseudo-terminal, as a person types: two turns with accepted drafts in green and a stats
    line each, /reset, then Ctrl-D."""
    target, draft = map(str, chat_pair)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verispec.cli",
            "chat",
            "--target",
            target,
            "--draft",
            draft,
            "-k",
            "3",
            "--max-new-tokens",
            str(N),
            "--ignore-eos",
            "--threads",
            "1",
        ],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    try:
        screen = _read_until(leader, "> ")
        assert "/reset starts over, Ctrl-D quits" in screen
        for message in ("hello", "more please"):
            os.write(leader, f"{message}\n".encode())
            screen = _read_until(leader, "> ")
            assert "tok/s, tau" in screen and "acceptance" in screen
        assert GREEN in screen  # drafts the target accepted, coloured on a terminal
        os.write(leader, b"/reset\n")
        assert "(a new conversation)" in _read_until(leader, "> ")
        os.write(leader, b"\x04")  # Ctrl-D
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        os.close(leader)


def test_a_reply_runs_to_the_end_of_its_turn_unless_told(chat_pair) -> None:
    """No max_new_tokens (the chat command's default): the reply runs to EOS or the room left in the context, not a
    fixed count."""
    target = load_model(chat_pair[0])
    chat = Chat(target, load_chat_template(chat_pair[0]).render, ignore_eos=True)
    steps = chat.say("hello")
    for _ in steps:
        pass
    assert steps.stats.new_tokens > 128  # the old fixed default
    assert len(chat._cached) == target.context_length - 1  # prompt and reply fill the context (the last token not yet
    # in the cache)


def test_a_gguf_targets_tokenizer_is_built_once_per_load(tmp_path, monkeypatch, capsys) -> None:
    """The chat template of a loaded GGUF target is held by the target's own tokenizer, not a second one built from
    the file: `generate --chat`, `chat`, the server and a library user's `load_chat_template(path, tokenizer)` build
    the file's tokenizer once, when the model loads, and render what a template of its own renders."""
    path = write_gguf(tmp_path / "m.gguf", gguf_config(len(bpe_vocab()[0])), lambda name: gguf.GGMLQuantizationType.F32)
    messages = [{"role": "user", "content": "hi"}]
    expected = load_chat_template(path).render(messages)
    builds = mock.patch.object(gguf_tokenizer, "_byte_level_bpe", wraps=gguf_tokenizer._byte_level_bpe)
    options = ["--target", str(path), "--max-new-tokens", "2", "--color", "never", "--threads", "1"]
    with builds as built:
        assert main(["generate", "--chat", "hi", *options]) == 0
        assert built.call_count == 1
        monkeypatch.setattr("builtins.input", lambda prompt: "hi" if built.call_count == 1 else _end())
        assert main(["chat", *options]) == 0
        assert built.call_count == 2
        target = load_model(path)
        serving_app(target, None, path)
        assert load_chat_template(path, target.tokenizer).render(messages) == expected
        assert built.call_count == 3
    capsys.readouterr()


def _end() -> str:
    raise EOFError
