"""Grammars that constrain the output: a JSON schema, a regular expression, or a Lark or GBNF grammar, compiled by
llguidance (the Rust library behind Guidance, also a structured-output backend of vLLM and SGLang).

A `Grammar` is what the user wrote, checked and compiled to llguidance's form; it knows no tokenizer. `bind` turns it
into a `TokenGrammar` for one target: llguidance's view of the target's vocabulary and a matcher built once, which
every generation copies (`TokenGrammar.start`) into its own `verispec.constraint.Constraint`.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import llguidance
from tokenizers import Tokenizer

from verispec.constraint import Constraint
from verispec.errors import GrammarError, InvalidArgumentError
from verispec.models.protocol import CausalLM

# JSON as Python's json.dumps writes it: one space after ':' and ','; no other whitespace. Flexible whitespace would
# let a model pad without end (llguidance's default); a schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "regex", "grammar")


def one_line(message: str) -> str:
    """llguidance's messages span lines (a regex error draws a caret under its pattern): one line for the CLI and the
    server's error JSON."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


@dataclass(frozen=True)
class Grammar:
    """What the output must match, compiled to llguidance's grammar (`compiled`). `kind` says what it was written in
    (one of KINDS), for messages."""

    kind: str
    compiled: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """Output that is one JSON value valid under `schema` (a dict, or its JSON text), written as json.dumps writes
        it (see JSON_OPTIONS)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as err:
            raise GrammarError(f"the JSON schema cannot be read: {one_line(str(err))}") from None
        return cls._checked("json_schema", compiled, "the JSON schema")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output that matches `pattern` in full (Rust's regex syntax, close to Python's without look-around)."""
        _text(pattern, "a regex")
        return cls._checked("regex", llguidance.LLMatcher.grammar_from_regex(pattern), "the regex")

    @classmethod
    def cfg(cls, text: str) -> Grammar:
        """Output in the language of a context-free grammar: Lark's syntax (as llguidance extends it) or llama.cpp's
        GBNF (told apart by its `::=`), starting from `start` (Lark) or `root` (GBNF)."""
        _text(text, "a grammar")
        try:
            compiled = llguidance.grammar_from("grammar", text)
        except ValueError as err:  # GBNF that does not convert to Lark
            raise GrammarError(f"the grammar cannot be read: {one_line(str(err))}") from None
        return cls._checked("grammar", compiled, "the grammar")

    @classmethod
    def _checked(cls, kind: str, compiled: str, what: str) -> Grammar:
        problem = llguidance.LLMatcher.validate_grammar(compiled)
        if problem:
            raise GrammarError(f"{what} cannot be used: {one_line(problem)}")
        return cls(kind, compiled)


def _text(value: Any, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{what} must be a non-empty string, got {value!r}")


def grammar_option(
    json_schema: dict | str | None = None, regex: str | None = None, grammar: str | Grammar | TokenGrammar | None = None
) -> Grammar | TokenGrammar | None:
    """The one constraint that `generate`'s options ask for (None: none): `json_schema` (a dict or its JSON text),
    `regex`, or `grammar` (Lark or GBNF text, or an already compiled `Grammar` / `TokenGrammar`); at most one."""
    given = [name for name, value in zip(KINDS, (json_schema, regex, grammar)) if value is not None]
    if len(given) > 1:
        raise InvalidArgumentError(f"give at most one of json_schema, regex and grammar, not {' and '.join(given)}")
    if json_schema is not None:
        return Grammar.json_schema(json_schema)
    if regex is not None:
        return Grammar.regex(regex)
    if grammar is None or isinstance(grammar, (Grammar, TokenGrammar)):
        return grammar
    return Grammar.cfg(grammar)


class TokenGrammar:
    """A grammar over one target's tokens: `start` begins a generation's constraint (a copy of one matcher, built
    here, so that a grammar's compilation is paid once, where `bind` runs)."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, vocab_size: int, eos: frozenset[int]) -> None:
        self.grammar, self.tokenizer, self.vocab_size, self.eos = grammar, tokenizer, vocab_size, eos
        self._matcher = llguidance.LLMatcher(_vocabulary(tokenizer, vocab_size, eos), grammar.compiled, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(
                f"the {grammar.kind.replace('_', ' ')} cannot be used with this model's tokenizer: "
                f"{one_line(self._matcher.get_error())}"
            )

    def start(self) -> Constraint:
        """A new generation's state: nothing generated yet."""
        return Constraint(self._matcher.deep_copy(), self.vocab_size, self.eos)


def bind(grammar: Grammar | TokenGrammar | None, target: CausalLM, ignore_eos: bool = False) -> TokenGrammar | None:
    """`grammar` over `target`'s tokens (None stays None). The output of a grammar ends with an end-of-sequence token,
    so a target without one, and `ignore_eos`, are refused."""
    if grammar is None:
        return None
    if ignore_eos:
        raise InvalidArgumentError(
            "ignore_eos cannot be combined with a grammar: a constrained output ends with the "
            "end-of-sequence token once the grammar is complete"
        )
    eos = frozenset(t for t in target.eos_token_ids if t < target.vocab_size)
    if isinstance(grammar, TokenGrammar):
        if grammar.tokenizer is not target.tokenizer or grammar.vocab_size != target.vocab_size or grammar.eos != eos:
            raise InvalidArgumentError(f"this grammar was bound to another model's tokens; bind it to {target.name}")
        return grammar
    if not isinstance(grammar, Grammar):
        raise InvalidArgumentError(f"a grammar must be a verispec Grammar, got {type(grammar).__name__}")
    if not eos:
        raise GrammarError(
            f"{target.name} has no end-of-sequence token in its vocabulary, which a constrained output ends with"
        )
    return TokenGrammar(grammar, target.tokenizer, target.vocab_size, eos)


# llguidance's view of a vocabulary takes a while to build for a large one (it reads every token's bytes), so it is
# built once per tokenizer, vocabulary size and EOS set, and dropped with the tokenizer.
_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCABULARIES_LOCK = threading.Lock()  # the server binds on several threads


def _vocabulary(tokenizer: Tokenizer, vocab_size: int, eos: frozenset[int]) -> llguidance.LLTokenizer:
    key = vocab_size, eos
    with _VOCABULARIES_LOCK:
        built = _VOCABULARIES.setdefault(tokenizer, {})
        if key not in built:
            try:
                built[key] = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(eos))
            except (ValueError, RuntimeError) as err:
                raise GrammarError(f"llguidance cannot read this model's tokenizer: {one_line(str(err))}") from None
        return built[key]
