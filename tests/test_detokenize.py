"""Incremental detokenization: leading spaces, partial UTF-8 characters, stop-string hold-back."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from verispec.detokenize import TextTracker
from verispec.tokenizer import byte_level_tokenizer


def sentencepiece_like() -> Tokenizer:
    """Words with a '▁' marker whose decoder drops the first leading space, as Llama and Mistral tokenizers do."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def test_continuation_keeps_its_leading_space() -> None:
    tok = sentencepiece_like()
    assert tok.decode([2, 3]) == "world!"  # decoded alone, the space is gone
    tracker = TextTracker(tok, prompt=[1])
    tracker.add([2, 3], [True, False])
    assert tracker.text == " world!" and [p.text for p in tracker.ready(final=True)] == [" world", "!"]


def test_partial_utf8_is_held_until_the_character_completes() -> None:
    tok = byte_level_tokenizer()
    ids = tok.encode("é!").ids  # two byte tokens for é, one for !
    tracker = TextTracker(tok, prompt=tok.encode("x").ids)
    tracker.add(ids, [False] * len(ids))
    assert [p.text for p in tracker.pieces] == ["", "é", "!"]


def test_partial_stop_string_is_held_back_until_resolved() -> None:
    tok = byte_level_tokenizer()
    tracker = TextTracker(tok, prompt=[120], stop=["\n\n"])
    tracker.add(tok.encode("ab\n").ids, [False] * 3)
    assert "".join(p.text for p in tracker.ready()) == "ab"  # "\n" may begin the stop string
    kept = tracker.add(tok.encode("\ncd").ids, [False] * 3)
    assert kept == 1 and tracker.stopped and tracker.text == "ab"
    assert "".join(p.text for p in tracker.ready(final=True)) == ""  # the held "\n" is never shown
    assert len(tracker.pieces) == 4  # one piece per kept token, the completing one included
