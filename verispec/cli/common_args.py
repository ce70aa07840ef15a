"""The options that several commands share: the models and the method (made from the method families' option records,
drafters/options.py), decoding, grammars, the key/value memory and the runtime."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from verispec.checkpoints.blocks import FORMATS
from verispec.drafters.adaptive import AUTO_MAX_K
from verispec.drafters.choice import AUTO_SUMMARY
from verispec.drafters.options import AUTO, FIXED_K, SUFFIX_K, Option
from verispec.drafters.registry import FAMILIES, OPTIONS, auto_k_families, option_help
from verispec.engine.kv_budget import DEFAULT_CONTEXT, DEFAULT_MEMORY, byte_size
from verispec.errors import InvalidArgumentError
from verispec.models.auto import BACKENDS
from verispec.models.precision import DEFAULT_DTYPE, DTYPES, KV_DTYPES


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    """A chat template in place of the target's own (chat, generate --chat, serve, bench's Spec-Bench turns)."""
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to render conversations with instead of the target's own (as vLLM's "
        "--chat-template and llama.cpp's --chat-template-file): for a checkpoint shipped without one",
    )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The target, the method and its options: what `loading.load_models` builds from (generate, chat, serve,
    bench-serve)."""
    parser.add_argument(
        "--target",
        help="target checkpoint: a Hugging Face folder or a GGUF file; default: the "
        "shipped models/stdlib-target, with models/stdlib-draft as the draft",
    )
    parser.add_argument(
        "--draft",
        help="draft checkpoint, a folder or a GGUF file (--method draft, or auto); with a folder --target and without "
        "it, plain decoding",
    )
    parser.add_argument(
        "--method",
        choices=[AUTO, *FAMILIES],
        help=f"{AUTO}: {AUTO_SUMMARY}; "
        + "; ".join(f"{name}: {family.summary}" for name, family in FAMILIES.items())
        + f" (default: draft with --draft or for the shipped pair, {AUTO} for a GGUF --target, else autoregressive)",
    )
    parser.add_argument(
        "-k",
        help=f"tokens drafted per step, or auto: chosen per step from this generation's acceptance and timings, up to "
        f"{AUTO_MAX_K}, and 0 (plain decoding) where drafting does not pay (default {AUTO} for "
        f"{', '.join(auto_k_families())} chains, suffix's cutting each proposal by its own estimates; {FIXED_K} for "
        f"eagle without its head's own setting and for trees but suffix's, {SUFFIX_K} deep; layerskip: the k in its "
        "plan; lookahead drafts N - 1, set by --ngram-size, or auto: on or off)",
    )
    parser.add_argument(
        "--head",
        help="eagle, medusa, suffix with --eagle-below, auto: the head's folder (default: "
        "models/stdlib-eagle or models/stdlib-medusa for the shipped target, or the head shipped for a GGUF "
        "target's model)",
    )
    # The methods' options, as their records declare them (drafters/options.py). Each defaults to None here, so that
    # only what was given reaches the method record (the record holds the defaults) and an option given to a method
    # that does not take it is refused.
    for name, option in OPTIONS.items():
        parser.add_argument(
            option.flag_for(name), dest=name, type=_parsed(option), choices=option.choices, help=option_help(name)
        )


def _parsed(option: Option) -> Callable[[str], Any]:
    """`option`'s parse, its own refusal kept as argparse's message (argparse words a ValueError generically)."""

    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except InvalidArgumentError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = option.parse.__name__  # argparse names the type in its own refusals
    return parse


def add_decoding_args(parser: argparse.ArgumentParser, max_new_tokens: int | None = 128) -> None:
    """What `stream` takes, as generate and chat give it (a chat's replies run to the end of their turn unless told:
    `max_new_tokens` None); the system message and the colours of the output."""
    to_the_end = "most tokens a reply (default: to the end of its turn, the room left in the context)"
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help=f"(default {max_new_tokens})" if max_new_tokens else to_the_end,
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default) decodes greedily, as does any value below 1e-5"
    )
    parser.add_argument("--top-k", type=int, default=0, help="0 (default) keeps every token")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string (repeatable); backslash escapes as in Python: '\\n\\n', '\\t', '\\\\', '\\x41', '\\u00e9'",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    parser.add_argument("--system", help="a system message at the head of a chat")
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="show accepted draft tokens in green (auto: when printing to a terminal)",
    )


def add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """What the output must follow: one grammar at most."""
    grammar = parser.add_mutually_exclusive_group()
    grammar.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to one JSON value valid under the JSON schema in FILE",
    )
    grammar.add_argument("--regex", help="constrain the output to text that this regular expression matches in full")
    grammar.add_argument(
        "--grammar",
        metavar="FILE",
        help="constrain the output to the language of a Lark (.lark) or GBNF (.gbnf, llama.cpp's) grammar in FILE",
    )


def add_kv_args(parser: argparse.ArgumentParser) -> None:
    """A server's key/value memory (engine/kv_budget.py)."""
    parser.add_argument(
        "--max-model-len",
        type=int,
        help=f"tokens a request's prompt and answer may take (default: the smaller of the model's "
        f"context and {DEFAULT_CONTEXT})",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        metavar="SIZE",
        help=f"keys and values all running requests may hold together, e.g. 2GiB or 512MiB "
        f"(default {DEFAULT_MEMORY // 2**30}GiB); a request waits for room, and one that could "
        f"never fit is refused",
    )


def add_dtype_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """--dtype, auto by default in every command that takes it; `what` it sets."""
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=["auto", *sorted(DTYPES)],
        help=f"{what}: auto (default): a GGUF file's own formats (its ggml blocks kept where verispec's kernels run); "
        "else bfloat16 where verispec's kernels run, else float32",
    )


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Where and how the models run."""
    parser.add_argument("--device", default="cpu")
    add_dtype_arg(parser, "the models' dtype")
    parser.add_argument(
        "--quantize",
        choices=sorted(FORMATS),
        help="keep the target's projections in this block format (its LM head in q8_0), on "
        "verispec's kernels with float32 activations",
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPES,
        help="what the key/value cache holds: auto (default): float16 beside block-quantized weights "
        "(as llama.cpp), else the activations' dtype; float16 goes with float32 activations",
    )
    parser.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        help="batch-invariant forwards: greedy output bit-identical to plain decoding in any dtype "
        "(default: on for generate and serve where the native target runs on verispec's "
        "kernels, which makes it free; the server's batches are then exact too)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="native runtime, transformers, or auto: native where it covers the architecture",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="threads, verispec's kernels' and torch's (default: $VERISPEC_THREADS, else "
        "$OMP_NUM_THREADS, else the physical cores this process may run on)",
    )
