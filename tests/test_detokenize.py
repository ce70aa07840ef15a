"""Incremental detokenization: leading spaces, partial UTF-8 characters, stop-string hold-back."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from verispec.checkpoints.tokenizer import byte_level_tokenizer
from verispec.detokenize import TextTracker
from verispec.stops import StopMatcher


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


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for s in stops if (i := text.find(s)) >= 0]
    return min(found) if found else None


def test_the_stop_matcher_agrees_with_a_plain_search() -> None:
    """Random pieces over a small alphabet (overlapping, self-similar stop strings): where a stop is first complete,
    the earliest start among those completed in that piece, and the longest stop prefix the text ends with."""
    rng = random.Random(0)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        matcher, text = StopMatcher(stops), ""
        while True:
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            found = matcher.feed(piece)
            before, text = text, text + piece
            if found is not None:
                ends_here = [i for s in stops if (i := text.find(s)) >= 0 and i + len(s) > len(before)]
                assert _first_stop(before, stops) is None and found == min(ends_here)
                break
            assert _first_stop(text, stops) is None
            held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            assert matcher.held == held
