"""A draft with another tokenizer than the target's: the token tables and the vocabularies' intersection (byte-level and
SentencePiece-style), text re-encoded between them, greedy identity of both ways (intersection and reencode) on a pair
whose ids and merges differ, and the refusals that say which way would apply. The sampling chi-square tests on an
enumerable pair are in test_cross_vocab_sampling.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from verispec import InvalidArgumentError, generate
from verispec.checkpoints.folder import save_checkpoint
from verispec.checkpoints.tokenizer import EOT, byte_level_tokenizer, load_tokenizer
from verispec.cli import main
from verispec.drafters.cross_vocab import INTERSECTION, REENCODE, translation_for
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.registry import Method, Resources, build_drafter, check_method
from verispec.errors import TokenizerMismatchError
from verispec.models.auto import load
from verispec.models.native import load_model
from verispec.retokenize import DraftText, Encoder
from verispec.vocab_map import shared_tokens, token_table
from vocabularies import byte_bpe

pytestmark = pytest.mark.usefixtures("single_thread")

STDLIB = Path(__file__).resolve().parents[1] / "models" / "stdlib-draft"
PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32, 100, 101, 102]  # as test_drafters.py's
N = 40


@pytest.fixture(scope="module")
def twin(twin_dir):
    return load_model(twin_dir)


@pytest.fixture(scope="module")
def truth(target) -> list[int]:
    return generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens


def test_byte_level_pieces_are_what_the_tokenizer_decodes() -> None:
    tok = load_tokenizer(STDLIB)
    table = token_table(tok)
    assert table.special == {0} and table.pieces[0] == EOT.encode() and len(table.singles) == 256
    for i in range(1, tok.get_vocab_size()):
        text = table.pieces[i].decode("utf-8", "replace")
        if "\ufffd" not in text:
            assert text == tok.decode([i]), i
    same = shared_tokens(table, table, 8192, 8192)
    assert len(same) == 8192 and torch.equal(same.draft_ids, same.target_ids)


def sentencepiece_style() -> Tokenizer:
    """SentencePiece's spelling in a BPE: "▁" for a space, "<0xNN>" for a raw byte (byte fallback), <s> special."""
    vocab = {"<unk>": 0, "<0x41>": 1, "<0xE2>": 2, "A": 3, "▁A": 4, "B": 5, "▁AB": 6, "▁": 7}
    merges = [("▁", "A"), ("▁A", "B")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", EOT])
    return tok


def test_sentencepiece_and_byte_level_spellings_meet_in_bytes() -> None:
    sp = token_table(sentencepiece_style())
    assert sp.pieces[1] == sp.pieces[3] == b"A" and sp.pieces[4] == b" A" and sp.pieces[2] == b"\xe2"
    assert sp.singles[ord("A")] == 1 and sp.special == {8, 9}  # the lowest id stands for "A"
    byte = byte_bpe(["A", "B", "Ġ", "ĠA", "C", "<s>"], [("Ġ", "A")])  # a byte-level "<s>" is text, not a control
    shared = shared_tokens(token_table(byte), sp, 7, 10)  # (target: the byte-level one, ids 0-6)
    pairs = dict(zip(shared.draft_ids.tolist(), shared.target_ids.tolist()))
    assert pairs == {1: 0, 4: 3, 5: 1, 7: 2, 9: 6}  # A (byte fallback's id), " A", B, " ", <|endoftext|>
    assert shared.covered([0, 3, 4, 4]) == 0.5


def test_a_tokenizer_not_spelled_in_bytes_has_no_table() -> None:
    tok = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert token_table(tok) is None


def test_bytes_cut_inside_a_character_encode_as_byte_tokens() -> None:
    tok = load_tokenizer(STDLIB)
    encoder = Encoder(tok, token_table(tok))
    data = "x = '→'\n".encode()
    for cut in range(len(data) + 1):  # every cut, the arrow's three bytes split anywhere
        for part in (data[:cut], data[cut:]):
            assert encoder.bytes_of(encoder.encode(part)) == part
    assert encoder.encode(data[:6]) == encoder.encode(b"x = '") + [encoder.table.singles[0xE2]]


def test_the_drafts_text_grows_as_one_encoding_of_the_whole() -> None:
    """Fed a byte at a time (a target whose tokens are bytes), the draft's tokens end as the tokenizer's own encoding
    of the whole text, each update leaving the tokens before its look-behind as they were."""
    draft, target = load_tokenizer(STDLIB), byte_level_tokenizer()
    text = DraftText(token_table(target), Encoder(draft, token_table(draft)))
    source = "def area(r):\n    return 3.14159 * r ** 2  # πr²\n"
    ids, data = target.encode(source).ids, source.encode()
    assert len(ids) == len(data)
    before: list[int] = []
    for n in range(1, len(ids) + 1):
        same = text.update(ids[:n])
        assert text.ids[:same] == before[:same]
        assert b"".join(text.draft.table.pieces[i] for i in text.ids) == data[:n]
        before = list(text.ids)
    assert text.ids == draft.encode(source, add_special_tokens=False).ids


WAYS = {
    "intersection chain": (Method("draft", 3, {"vocab_map": INTERSECTION}), None),
    "intersection tree": (Method("draft", 3, {"vocab_map": INTERSECTION, "branch": 2, "branch_depth": 2}), None),
    "intersection among 40 tokens": (Method("draft", 3, {"vocab_map": INTERSECTION}), torch.arange(200, 240)),
    "reencode": (Method("draft", 3, {"vocab_map": REENCODE}), None),
    "auto": (Method("draft", 3, {"vocab_map": "auto"}), None),  # (the intersection)
}


@pytest.mark.parametrize("name", WAYS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_both_ways_decode_exactly_what_the_target_does(target, twin, truth, name, temperature) -> None:
    """Greedy: the plain output, token for token, through more drafted tokens than the twin's context holds (its
    window moves). Sampling: the same tokens as plain decoding has under the same seed is not promised, but each
    run is reproducible and stays in the target's vocabulary."""
    method, vocab = WAYS[name]
    drafter = build_drafter(method, Resources(draft=twin, target=target))
    if vocab is not None:  # the draft vocabulary, narrowed to the shared tokens
        drafter = DraftModel(twin, 3, vocab=vocab, translation=drafter.translation)
        assert set(drafter.vocab.tolist()) == set(range(200, 240)) - {256, 257, 258}
    if temperature == 0:
        out = generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
        assert out.tokens == truth
        if method.k != "auto":  # (auto drafts where this machine's timings say it pays)
            assert out.stats.accepted > (N // 4 if vocab is None else 0)  # the twin agrees where it reads bytes
    else:
        runs = [
            generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True, temperature=temperature, seed=5).tokens
            for _ in range(2)
        ]
        assert runs[0] == runs[1] and len(runs[0]) == N and max(runs[0]) < target.vocab_size


@pytest.mark.parametrize("way", [INTERSECTION, REENCODE])
def test_a_transformers_draft_drafts_both_ways_a_forward_at_a_time(target, twin_dir, truth, way) -> None:
    """Through transformers the draft has no greedy chains nor LM heads over part of the vocabulary: the intersection
    takes the shared tokens' logits from the whole head, re-encoding drafts a forward at a time."""
    draft = load(twin_dir, backend="transformers")
    assert not (draft.capabilities.greedy_chains or draft.capabilities.vocab_heads)
    drafter = build_drafter(Method("draft", 3, {"vocab_map": way}), Resources(draft=draft, target=target))
    out = generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
    assert out.tokens == truth and out.stats.accepted > N // 4


@pytest.mark.parametrize("way", [INTERSECTION, REENCODE])
def test_both_ways_under_a_grammar_decode_what_the_constrained_target_does(target, twin, way) -> None:
    """The grammar is the target's: the intersection's q is masked by it over the target's ids, re-encoded proposals
    are cut where it forbids them."""
    drafter = build_drafter(Method("draft", 3, {"vocab_map": way}), Resources(draft=twin, target=target))
    pattern = r"(ab|cd)[0-9]{2,4}-[xyz]+q"
    out = generate(target, PROMPT, drafter, max_new_tokens=16, regex=pattern)
    assert out.tokens == generate(target, PROMPT, max_new_tokens=16, regex=pattern).tokens
    sampled = [
        generate(target, PROMPT, drafter, max_new_tokens=16, regex=pattern, temperature=1.0, seed=seed)
        for seed in range(3)
    ]
    assert all(re.fullmatch(pattern, s.text) or s.stop_reason == "max_new_tokens" for s in sampled)


def test_intersection_drafts_the_targets_ids_of_shared_tokens(target, twin) -> None:
    translation = translation_for(target, twin, INTERSECTION)
    assert len(translation.shared) == 257  # the 256 bytes and <|endoftext|>; the merged tokens are the twin's own
    twins, d = translation.shared.twins(), target.tokenizer.token_to_id("d")
    assert twins[d] == 255 - d and twins[256] == 259
    assert translation.restrict(torch.tensor([257, 5, 256]))[1].tolist() == [250]  # merged tokens have no twin


def test_reencode_proposes_the_target_tokens_of_the_drafts_settled_text(target, twin) -> None:
    """The draft's text "de" + "f": as the target's tokens d, e, f; where the last draft token ("def" after "de") could
    merge with what follows, the proposal stops before it."""
    translation = translation_for(target, twin, REENCODE)
    d, e, f = (target.tokenizer.token_to_id(ch) for ch in "def")
    de = twin.tokenizer.token_to_id("de")
    assert translation.proposal([de, 255 - f]) == [d, e]  # "f" may still merge with what follows
    assert translation.proposal([255 - d, 255 - e, 255 - f]) == [d, e]
    assert translation.proposal([255 - d, 259, 255 - e]) == [d]  # a control token ends the draft's text


def test_a_draft_with_another_tokenizer_is_refused_with_the_ways_that_would_draft(target, twin) -> None:
    with pytest.raises(
        TokenizerMismatchError,
        match="vocab_map intersection .* would draft among the 257 tokens both share .*; vocab_map reencode",
    ):
        generate(target, PROMPT, DraftModel(twin, 3), max_new_tokens=4)
    with pytest.raises(
        TokenizerMismatchError, match="vocab_map reencode does not apply .* branch > 1 .* vocab_map intersection"
    ):
        translation_for(target, twin, REENCODE, tree=True)
    with pytest.raises(InvalidArgumentError, match="reencode proposes chains"):
        DraftModel(twin, 3, branch=2, translation=translation_for(target, twin, REENCODE))
    assert translation_for(target, target, "auto") is None  # the same tokenizer: nothing to map


def test_no_shared_token_leaves_reencode(tmp_path, target) -> None:
    from verispec.checkpoints.random_init import random_weights, tiny_config

    config = tiny_config(vocab_size=3, eos_token_id=2)
    other = load_model(save_checkpoint(tmp_path, config, random_weights(config), byte_bpe(["ab", "cd"], [], ("<e>",))))
    with pytest.raises(
        TokenizerMismatchError, match="intersection does not apply .* share no token; vocab_map reencode .* would"
    ):
        translation_for(target, other, INTERSECTION)
    assert translation_for(target, other, "auto").way == REENCODE


def test_a_translation_for_one_target_refuses_another(target, twin, unrelated) -> None:
    translation = translation_for(target, twin, INTERSECTION)
    translation.check(unrelated)  # another model with the same tokenizer
    with pytest.raises(TokenizerMismatchError, match="built for another tokenizer"):
        translation.check(twin)


def test_the_registry_and_command_line_check_vocab_map(capsys, pair_dirs, twin_dir, twin) -> None:
    with pytest.raises(InvalidArgumentError, match="vocab_map must be one of intersection, reencode, auto"):
        check_method(Method("draft", 3, {"vocab_map": "both"}))
    with pytest.raises(InvalidArgumentError, match="vocab_map maps the draft's tokens to the target's"):
        build_drafter(Method("draft", 3, {"vocab_map": INTERSECTION}), Resources(draft=twin))
    target = str(pair_dirs[0])
    code = main(["generate", "def", "--target", target, "--draft", str(twin_dir), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "(--vocab-map intersection) would" in err
    code = main(
        [
            "generate",
            "def",
            "--target",
            target,
            "--draft",
            str(twin_dir),
            "--max-new-tokens",
            "8",
            "--vocab-map",
            "reencode",
            "-k",
            "3",
            "--ignore-eos",
        ]
    )
    assert code == 0 and capsys.readouterr().out.startswith("def")
