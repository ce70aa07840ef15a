"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built as a `tokenizers.Tokenizer` that maps text to
the ids llama.cpp maps it to.

- `gpt2` (byte-level BPE): the file's merges, and the pre-tokenizer `tokenizer.ggml.pre` names, as the regular
  expressions llama.cpp's `llm_tokenizer_bpe` applies for it (src/llama-vocab.cpp), one after the other, each
  splitting the pieces the last one left (what `Split(..., "isolated")` does), then the byte-level alphabet.
- `llama` (SentencePiece): merges ranked by the file's scores (as transformers rebuilds them), byte fallback to
  `<0xNN>`, and llama.cpp's space prefix: a `▁` before every stretch of text that starts the input or follows a
  special token (`add_space_prefix`, on unless the file says otherwise), spaces as `▁`.
Control (and unknown) tokens are special tokens, user-defined ones added tokens: matched whole in the text, as
llama.cpp matches them. BOS and EOS are added per `add_bos_token` / `add_eos_token`, with llama.cpp's defaults
where the file is silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from verispec.checkpoints.gguf_file import GGUFFile
from verispec.checkpoints.tokenizer import conventional_eos
from verispec.errors import CheckpointError

# llama.cpp's regular expressions, by pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_*); llama3's and qwen2's with the
# case-insensitive contractions spelled out, as llama.cpp adapted them.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# Mistral's tekken (Nemo, Small 3) as llama.cpp adapted it: a letter is upper case where it is not a-z and lower case
# where it is not A-Z (llama.cpp's regex engine knows no \p{Lu} or \p{Ll}), so any other letter counts as either
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one family of `tokenizer.ggml.pre` names."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is that token, whatever the merges would make
    add_bos: bool = False  # llama.cpp's add_bos_token where the file has none


def _family(names: str, spec: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), spec)


PRE_TOKENIZERS = (
    _family("default", PreTokenizer(DEFAULT))
    | _family("gpt-2 phi-2 mpt olmo jina-es jina-de jina-v2-es jina-v2-de gigachat exaone4", PreTokenizer((GPT2,)))
    | _family(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True),
    )
    | _family("dbrx smaug-bpe", PreTokenizer((LLAMA3,)))
    | _family("starcoder refact command-r smollm codeshell exaone minerva-7b", PreTokenizer((r"\p{N}", GPT2)))
    | _family("qwen2 deepseek-r1-qwen megrez stablelm2 hunyuan", PreTokenizer((QWEN2,)))
    | _family("tekken", PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True))
)
SPACE = "\u2581"  # SentencePiece's visible space
# llama.cpp's ids for a SentencePiece vocabulary whose file names none
SENTENCEPIECE_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
# What ends a generation besides the ids a file names (EOS, end of turn, end of message): the tokens llama.cpp ends
# one on by their text (src/llama-vocab.cpp's `special_eog_ids`; Gemma's files name only <eos>, not <end_of_turn>),
# and its fill-in-the-middle pad, repository and file-separator tokens, by the file's key or else by their text
END_OF_GENERATION = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)  # fmt: skip
FILL_IN_THE_MIDDLE_ENDS = {
    "fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_token_id": ("<|file_sep|>",),
}
SPECIAL_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF file's tokenizer and what goes with it: its end-of-generation ids (llama.cpp's: the EOS, end of turn
    and message the file names, and the tokens llama.cpp ends on by their text), its special tokens by transformers'
    names (`bos_token`, ...: what a chat template may refer to), and its chat template (None where it has none)."""

    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    special_tokens: dict[str, str]
    chat_template: str | None


def read_vocab(file: GGUFFile) -> GGUFVocab:
    """The tokenizer of `file`; a file without one, or with one llama.cpp would read differently from how this
    reads it, is refused."""
    path, model = file.path, file.get("tokenizer.ggml.model", str)
    tokens: list[str] = file.get("tokenizer.ggml.tokens", list) or []
    if model is None or not tokens:
        raise CheckpointError(
            f"{path}: no tokenizer in its metadata (tokenizer.ggml.model and tokenizer.ggml.tokens); "
            "verispec runs a GGUF file with its own tokenizer only"
        )
    types: list[int] = file.get("tokenizer.ggml.token_type", list) or [TokenType.NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{path}: the vocabulary holds the same token twice")
    if model == "gpt2":
        tokenizer, add_bos = _byte_level_bpe(file, tokens)
    elif model == "llama":
        tokenizer, add_bos = _sentencepiece(file, tokens), True
    else:
        raise CheckpointError(
            f"{path}: tokenizer model {model!r}; verispec reads gpt2 (byte-level BPE) and llama (SentencePiece)"
        )
    _add_special_tokens(tokenizer, tokens, types, path)
    ids = _special_ids(file, len(tokens), sentencepiece=model == "llama")
    added = {}  # what the post-processor adds: BOS before, EOS after
    for flag, key, default in (("add_bos_token", "bos_token_id", add_bos), ("add_eos_token", "eos_token_id", False)):
        if file.get(f"tokenizer.ggml.{flag}", bool, default):
            if key not in ids:
                raise CheckpointError(f"{path}: tokenizer.ggml.{flag} is true, but tokenizer.ggml.{key} is not set")
            added[key] = tokens[ids[key]]
    tokenizer.post_processor = _added_around(added.get("bos_token_id"), added.get("eos_token_id"), tokenizer)
    template = file.get("tokenizer.chat_template", str)
    return GGUFVocab(tokenizer, _end_of_generation(file, tokenizer, ids), _by_name(tokens, ids), template)


def _end_of_generation(file: GGUFFile, tokenizer: Tokenizer, ids: dict[str, int]) -> frozenset[int]:
    """The ids llama.cpp ends a generation on: those the file names, END_OF_GENERATION's and
    FILL_IN_THE_MIDDLE_ENDS' (the file's id, else the first token found of those texts); as llama.cpp, not <|end|>
    beside <|call|> and <|return|> or <|flush|> (harmony's and solar-open's end of a message, not of the turn)."""
    by_text = {text: tid for text in END_OF_GENERATION if (tid := tokenizer.token_to_id(text)) is not None}
    calls = {"<|call|>", "<|calls|>"} & by_text.keys() and {"<|return|>", "<|flush|>"} & by_text.keys()
    if calls and "<|end|>" in by_text:
        del by_text["<|end|>"]
    found = {ids[key] for key in ("eos_token_id", "eot_token_id", "eom_token_id") if key in ids} | set(by_text.values())
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    for key, texts in FILL_IN_THE_MIDDLE_ENDS.items():
        named = file.get(f"tokenizer.ggml.{key}", int)
        by_its_text = (tid for text in texts if (tid := tokenizer.token_to_id(text)) is not None)
        tid = named if named is not None and 0 <= named < size else next(by_its_text, None)
        if tid is not None:
            found.add(tid)
    return frozenset(found) or conventional_eos(tokenizer)


def chat_metadata(file: GGUFFile) -> tuple[dict[str, str], str | None]:
    """What a chat template needs of `file` besides its tokenizer, read from the metadata alone: the special tokens
    by transformers' names (`GGUFVocab.special_tokens`) and the template (None where it has none)."""
    tokens: list[str] = file.get("tokenizer.ggml.tokens", list) or []
    ids = _special_ids(file, len(tokens), sentencepiece=file.get("tokenizer.ggml.model", str) == "llama")
    return _by_name(tokens, ids), file.get("tokenizer.chat_template", str)


def _by_name(tokens: list[str], ids: dict[str, int]) -> dict[str, str]:
    return {name: tokens[ids[key]] for name, key in SPECIAL_KEYS.items() if key in ids}


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> tuple[Tokenizer, bool]:
    """GPT-2-style BPE over bytes spelled as characters, split first as llama.cpp splits for the pre-tokenizer."""
    name = file.get("tokenizer.ggml.pre", str, "default")  # llama.cpp's choice too where the file names none
    if name not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{file.path}: pre-tokenizer {name!r} (tokenizer.ggml.pre), which verispec does not "
            f"know; it knows {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    pre = PRE_TOKENIZERS[name]
    merges = file.get("tokenizer.ggml.merges", list)
    if merges is None:
        raise CheckpointError(f"{file.path}: a BPE tokenizer without tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [(merge[:cut], merge[cut + 1 :]) for merge in merges if (cut := merge.find(" ", 1)) > 0]
    # tokenizers needs both halves and their join in the vocabulary; a merge that makes no token never yields one
    pairs = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre.add_bos


def _sentencepiece(file: GGUFFile, tokens: list[str]) -> Tokenizer:
    """SentencePiece's BPE: merges by score, bytes the vocabulary lacks as `<0xNN>` tokens."""
    scores = file.get("tokenizer.ggml.scores", list) or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise CheckpointError(f"{file.path}: {len(tokens)} tokens but {len(scores)} scores")
    unk = _special_ids(file, len(tokens), sentencepiece=True).get("unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges_by_score(tokens, scores),
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = file.get("tokenizer.ggml.add_space_prefix", bool, True)
    spaces = normalizers.Replace(" ", SPACE)
    # A normalizer, not Metaspace: it runs on each stretch between special tokens, and prefixes one that already
    # starts with a space too, as llama.cpp does.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def merges_by_score(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scoring result first (longer left, then right part first
    among equals; a token's own splits by the ids of their parts): the order transformers' `generate_merges`
    gives SentencePiece vocabularies, whose merges a GGUF file does not store."""
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    owner, left, right = _splits(tokens, lengths)
    score = np.asarray(scores, np.float64)[owner]
    order = np.lexsort((right, left, owner, -lengths[right], -lengths[left], -score))  # the last key first
    return [(tokens[a], tokens[b]) for a, b in zip(left[order].tolist(), right[order].tolist())]


# Odd multipliers of the splits' polynomial hash (mod 2**64), each tried in turn where the vocabulary's own hashes
# collide under the last
HASH_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)


def _splits(tokens: Sequence[str], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (token, left, right) by ids where token = left + right: a 262k-token vocabulary has over a million
    places to cut, so each cut's halves are hashed at once in numpy and looked up among the tokens' hashes, every
    match then checked by its text; by dictionary, cut by cut, where no multiplier keeps the tokens' hashes apart.
    `lengths`: the tokens' lengths in characters."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    chars = np.frombuffer("".join(tokens).encode("utf-32-le"), np.uint32).astype(np.uint64) + np.uint64(1)
    cuts = np.maximum(lengths - 1, 0)
    owner = np.repeat(np.arange(len(tokens)), cuts)  # a cut's token, and where it cuts the joined text
    at = starts[owner] + 1 + np.arange(len(owner)) - np.repeat(np.cumsum(cuts) - cuts, cuts)
    for multiplier in HASH_MULTIPLIERS:
        found = _matches(chars, starts, ends, owner, at, multiplier)
        if found is not None:
            return found
    vocab = {token: i for i, token in enumerate(tokens)}
    triples = [
        (k, vocab[token[:i]], vocab[token[i:]])
        for k, token in enumerate(tokens)
        for i in range(1, len(token))
        if token[:i] in vocab and token[i:] in vocab
    ]
    found = np.array(triples, np.int64).reshape(-1, 3)
    return found[:, 0], found[:, 1], found[:, 2]


def _matches(
    chars: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    owner: np.ndarray,
    at: np.ndarray,
    multiplier: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`_splits` by hashes under `multiplier`; None where two tokens hash alike. The hash of characters x .. y - 1 of
    the joined text is p**y * (S[y] - S[x]), S the running sum of c * p**-q: one subtraction for any stretch."""
    n = len(chars)
    powers, inverses = (_powers(m, n + 1) for m in (multiplier, pow(multiplier, -1, 1 << 64)))
    sums = np.zeros(n + 1, np.uint64)
    np.cumsum(chars * inverses[:n], out=sums[1:])

    def hashed(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return powers[y] * (sums[y] - sums[x])

    ids = np.flatnonzero(ends > starts)  # (an empty token is no part of a split)
    table = hashed(starts[ids], ends[ids])
    order = np.argsort(table)
    table, ids = table[order], ids[order]
    if np.any(table[1:] == table[:-1]):
        return None

    def lookup(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.minimum(np.searchsorted(table, h), len(table) - 1)
        return ids[i], table[i] == h

    left, found = lookup(hashed(starts[owner], at))
    owner, at, left = owner[found], at[found], left[found]
    right, found = lookup(hashed(at, ends[owner]))
    owner, at, left, right = owner[found], at[found], left[found], right[found]
    # A hash says nothing for sure: each match's halves, character by character, against its token's
    exact = (ends[left] - starts[left] == at - starts[owner]) & (ends[right] - starts[right] == ends[owner] - at)
    owner, left, right = owner[exact], left[exact], right[exact]
    size = ends[owner] - starts[owner]
    first = np.cumsum(size) - size  # each match's first place in the flattened comparison
    place = np.arange(int(size.sum())) - np.repeat(first, size)  # the character's place in its token
    cut, token = np.repeat(ends[left] - starts[left], size), np.repeat(starts[owner], size)
    halves = np.where(place < cut, np.repeat(starts[left], size) + place, np.repeat(starts[right], size) + place - cut)
    same = chars[halves] == chars[token + place]
    exact = np.logical_and.reduceat(same, first) if len(first) else np.zeros(0, bool)
    return owner[exact], left[exact], right[exact]


def _powers(base: int, count: int) -> np.ndarray:
    """base**0 .. base**(count - 1), mod 2**64."""
    out = np.ones(count, np.uint64)
    np.cumprod(np.full(count - 1, base, np.uint64), out=out[1:])
    return out


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int], path: object) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as added tokens, at their own ids."""
    kinds = np.asarray(types)  # (150k tokens for Qwen: no loop over them in Python at every load)
    special = [tokens[i] for i in np.flatnonzero((kinds == TokenType.CONTROL) | (kinds == TokenType.UNKNOWN))]
    added = [tokens[i] for i in np.flatnonzero(kinds == TokenType.USER_DEFINED)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CheckpointError(f"{path}: its special tokens do not keep their ids")


def _special_ids(file: GGUFFile, size: int, sentencepiece: bool) -> dict[str, int]:
    """The special token ids the file names (with llama.cpp's SentencePiece defaults), those inside the vocabulary
    (llama.cpp ignores the others)."""
    keys = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "unknown_token_id", "padding_token_id")
    ids = dict(SENTENCEPIECE_DEFAULTS) if sentencepiece else {}
    ids |= {key: value for key in keys if (value := file.get(f"tokenizer.ggml.{key}", int)) is not None}
    return {key: value for key, value in ids.items() if 0 <= value < size}


def _added_around(bos: str | None, eos: str | None, tokenizer: Tokenizer) -> processors.TemplateProcessing | None:
    """The post-processor that puts BOS before and EOS after an encoded text (`add_special_tokens=True`)."""
    head, tail = [bos] if bos else [], [eos] if eos else []
    if not head and not tail:
        return None
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in {*head, *tail}],
    )
