"""What the command line reads besides its models: the prompt (argument, stdin or file), files an option names, the
grammar, backslash escapes in --stop, comma-separated numbers, and the decoding options checked before loading."""

from __future__ import annotations

import argparse
import codecs
import re
import sys
from pathlib import Path

from verispec.checkpoints.chat_template import read_template
from verispec.errors import InvalidArgumentError
from verispec.grammar import Grammar, grammar_option
from verispec.sampling import SamplingParams


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt argument, stdin for `-`, or --prompt-file: exactly one of them, and not empty."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise InvalidArgumentError(
            "give the prompt as an argument, as - to read stdin, or with --prompt-file FILE (exactly one)"
        )
    source = "stdin" if args.prompt == "-" else args.prompt_file
    if args.prompt_file is not None:
        text = read_file(args.prompt_file, "--prompt-file")
    else:
        try:
            text = sys.stdin.read() if args.prompt == "-" else args.prompt
        except UnicodeDecodeError:
            raise InvalidArgumentError("the prompt from stdin is not UTF-8 text") from None
    if not text:
        raise InvalidArgumentError("the prompt is empty" + (f" ({source})" if source else ""))
    return text


def read_file(path: str, option: str) -> str:
    """A UTF-8 text file that an option names, read whole."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidArgumentError(f"{option} {path}: no such file") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{option} {path}: not UTF-8 text") from None


def grammar_from(args: argparse.Namespace) -> Grammar | None:
    """What --json-schema FILE, --regex R or --grammar FILE (Lark or GBNF) ask the output to follow, compiled before
    any model loads (a bad schema costs no loading)."""
    read = lambda path, option: None if path is None else read_file(path, option)
    return grammar_option(read(args.json_schema, "--json-schema"), args.regex, read(args.grammar, "--grammar"))


# The escapes of a Python string literal (group 1); any other backslash (group 2) is refused rather than guessed.
_ESCAPE = re.compile(
    r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[^}]*\}|[0-7]{1,3}|[\\'\"abfnrtv])"
    r"|\\(.?)",
    re.DOTALL,
)


def unescape(text: str, option: str) -> str:
    """Decode backslash escapes (\\n, \\t, \\\\, \\xNN, \\uNNNN, \\N{name} ...) one at a time: "unicode_escape" over the
    whole string would read its non-ASCII characters as Latin-1 bytes (é would come back as Ã©)."""

    def one(match: re.Match) -> str:
        try:
            char = codecs.decode(match.group(0), "unicode_escape") if match.group(1) else None
        except UnicodeDecodeError:  # \\N{no such name}, \\U beyond U+10FFFF
            char = None
        if char is None or 0xD800 <= ord(char) <= 0xDFFF:  # a lone surrogate cannot be in any decoded text
            raise InvalidArgumentError(
                f"{option} '{text}': bad escape '{match.group(0)}' (known: \\n \\t \\r \\\\ "
                f"\\' \\\" \\a \\b \\f \\v \\0-\\777 \\xNN \\uNNNN \\UNNNNNNNN \\N{{name}})"
            )
        return char

    return _ESCAPE.sub(one, text)


def check_options(args: argparse.Namespace) -> None:
    """Options outside the method record that need no model to judge: checked before seconds of loading."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InvalidArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.system is not None and args.command == "generate" and not args.chat:
        raise InvalidArgumentError("--system goes with --chat (or `verispec chat`): a plain prompt has no roles")
    if getattr(args, "chat_template", None) is not None and args.command == "generate" and not args.chat:
        raise InvalidArgumentError("--chat-template goes with --chat (or `verispec chat`): a plain prompt has none")
    SamplingParams(args.temperature, args.top_k, args.top_p)  # raises on a bad temperature, top-k or top-p


def decoding_options(args: argparse.Namespace) -> dict:
    """`stream`'s options from the command line (generate, chat)."""
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def whole_numbers(text: str, option: str, what: str = "whole numbers such as 1,4,16") -> list[int]:
    """An option's comma-separated integers (--concurrency 1,4,16, --skip 2,3)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"{option} takes comma-separated {what}; got {text!r}") from None


def given_template(args: argparse.Namespace) -> str | None:
    """The chat template given with --chat-template (its Jinja text), or None for the target's own."""
    path = getattr(args, "chat_template", None)
    return None if path is None else read_template(path)
