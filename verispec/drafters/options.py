"""What a method is: a `Method` record (a family, a draft length k and options), and each family's options declared
once, as a typed record whose fields carry their default and their help (as vLLM's `SpeculativeConfig` and
llama.cpp's `common_params_speculative` do). The registry builds drafters from these records (drafters/builders.py),
the command line makes its flags from them (cli/common_args.py), a bench row's label is read by them
(`registry.method_named`), and the drafters' own constructors default to them, so that `--method suffix`,
`Method("suffix")`, `bench --methods suffix` and `serve --method suffix` are one method.

k is not an option: each record says what its family drafts when no k is given (`default_k`): `auto`, chosen step by
step (drafters/adaptive.py), for the chains where that measured best, a fixed depth elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from verispec.checkpoints.blocks import FORMATS
from verispec.drafters.cross_vocab import WAYS
from verispec.drafters.medusa import TREE_TOKENS
from verispec.errors import InvalidArgumentError
from verispec.models.twin import SAME_HEAD, TwinFormat

AUTO = "auto"  # k chosen per step
FIXED_K = 4  # a chain's or tree's depth where a family drafts a fixed k and none is given
SUFFIX_K = (
    8  # suffix decoding's deepest proposal where k is fixed (its tree's); most are shorter (spec_factor, min_prob)
)


@dataclass(frozen=True)
class Method:
    """A decoding method as a record, e.g. Method("draft", 4, {"branch": 2}); `options` holds only what was given,
    the family's record (`FAMILIES[family].options`) the rest."""

    family: str  # a family of registry.FAMILIES, or "auto": chosen for the target (drafters/choice.py)
    k: int | str | None = None  # tokens drafted per step, None for the family's default (`default_k`), or AUTO
    options: dict[str, Any] = field(default_factory=dict)
    reason: str | None = field(default=None, compare=False)  # where `auto` chose it: what and why, in one line

    @property
    def label(self) -> str:
        """What reports and logs call it: "draft k=4 branch=2"."""
        parts = [self.family] + ([] if self.k is None else [f"k={self.k}"])
        return " ".join(parts + [f"{name}={_show(value)}" for name, value in self.options.items()])


@dataclass(frozen=True)
class Option:
    """How an option's field is given and explained: the command line's flag, a label's name=value."""

    help: str  # what it does
    parse: Callable[[str], Any] = int  # what the command line's (or a label's) text becomes
    flag: str | None = None  # the command line's name, where it is not --name-with-dashes
    choices: tuple[str, ...] | None = None  # the values it takes, where they are a few names
    default_text: str | None = None  # the default as the help says it, where the value alone would not tell

    def flag_for(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")


def option(default: Any, help: str, parse: Callable[[str], Any] = int, **how: Any) -> Any:
    """A field of an option record: its default, and how it is given and explained (`Option`)."""
    return field(default=default, metadata={"option": Option(help, parse, **how)})


def described(record: type) -> dict[str, tuple[Option, Any]]:
    """An option record's fields: name -> (how it is given, its default)."""
    return {f.name: (f.metadata["option"], f.default) for f in fields(record)}


def skip_layers(text: str) -> list[int] | str:
    """The `skip` option's text: layer indices such as 2,3, or a layer-skip plan's .json file, kept as its path."""
    if text.endswith(".json"):
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(
            f"--skip takes comma-separated layer indices such as 2,3, or a plan's .json file; got {text!r}"
        ) from None


def _branch() -> Any:
    return option(
        1, "candidates per node at the first --branch-depth depths; > 1 verifies a token tree (native runtime)"
    )


def _branch_depth() -> Any:
    return option(1, "how many depths branch")


def _skip(default: str) -> Any:
    return option(
        None, "layers to skip, e.g. 2,3, or a layer-skip plan's file, e.g. PLAN.json", skip_layers, default_text=default
    )


def _vocab_map() -> Any:
    return option(
        None,
        "a draft with another tokenizer than the target's: intersection drafts among the tokens both vocabularies "
        "share (lossless under greedy decoding and sampling; chains and trees), reencode re-encodes the draft's "
        "greedy text into the target's tokens (chains; lossless too, under sampling as a one-hot guess), auto picks "
        "the first that applies (nothing for the same tokenizer)",
        str,
        choices=WAYS,
        default_text="the draft must have the target's tokenizer",
    )


def _draft_vocab() -> Any:
    return option(
        None,
        "draft over this many of the most frequent tokens only (a cheaper LM head; verification still scores them "
        "all); 0: all of them",
        default_text="the draft's or head's folder's own, 2048 for the shipped ones",
    )


@dataclass(frozen=True)
class NoOptions:
    """Plain decoding: nothing to set, no k."""

    def default_k(self) -> int | str | None:
        return None


@dataclass(frozen=True)
class DraftOptions:
    """A draft model: a chain, or a tree with branch > 1; another tokenizer through vocab_map."""

    branch: int = _branch()
    branch_depth: int = _branch_depth()
    draft_vocab: int | None = _draft_vocab()
    vocab_map: str | None = _vocab_map()

    def default_k(self) -> int | str | None:
        return AUTO if self.branch == 1 else FIXED_K


@dataclass(frozen=True)
class NgramOptions:
    """Prompt lookup."""

    max_ngram: int = option(3, "longest n-gram matched")
    min_ngram: int = option(1, "shortest n-gram matched")

    def default_k(self) -> int | str | None:
        return AUTO


@dataclass(frozen=True)
class LayerSkipOptions:
    """The target with some layers skipped."""

    skip: list[int] | str | Path | None = _skip("TARGET/layerskip.json")

    def default_k(self) -> int | str | None:
        return None if self.skip is None or isinstance(self.skip, (str, Path)) else FIXED_K  # None: the plan's own


@dataclass(frozen=True)
class SelfQuantOptions:
    """The target's quantized twin: a chain, or a tree with branch > 1."""

    format: str = option(TwinFormat.format, "the twin's projections in this block format", str, choices=tuple(FORMATS))
    head_format: str = option(
        TwinFormat.head,
        f"the twin's LM head in this block format, or {SAME_HEAD}: the target's own (a target's head already in it "
        "is shared, not requantized)",
        str,
        choices=(*FORMATS, SAME_HEAD),
    )
    skip: list[int] | str | Path | None = _skip("none")
    branch: int = _branch()
    branch_depth: int = _branch_depth()

    def default_k(self) -> int | str | None:
        return AUTO if self.branch == 1 else FIXED_K


@dataclass(frozen=True)
class LookaheadOptions:
    """Jacobi iteration; it drafts ngram - 1 tokens, so it takes no k."""

    window: int = option(5, "columns of the Jacobi window (W)")
    ngram: int = option(4, "n-gram size N, N - 1 tokens drafted", flag="--ngram-size")
    candidates: int = option(5, "most n-grams verified per step (G)")

    def default_k(self) -> int | str | None:
        return None


def _tree_tokens() -> Any:
    return option(None, "nodes of the tree the target verifies")


@dataclass(frozen=True)
class EagleOptions:
    """An EAGLE or EAGLE-3 head: a chain, or EAGLE-2's dynamic tree."""

    tree_top_k: int | None = option(
        None,
        "draft EAGLE-2's dynamic tree, expanding this many nodes per depth with this many children each (with "
        "--tree-tokens)",
    )
    tree_tokens: int | None = _tree_tokens()
    draft_vocab: int | None = _draft_vocab()

    def default_k(self) -> int | str | None:
        return None  # the head's card's (config.json's verispec.method), else FIXED_K


@dataclass(frozen=True)
class SuffixOptions:
    """Suffix decoding's trees and limits (the drafter's own, drafters/suffix.py)."""

    # vLLM's defaults (spec_factor's and min_prob's are ArcticInference's too)
    suffix_depth: int = option(24, "the longest string the suffix trees index, match and continuation")
    spec_factor: float = option(1.0, "propose at most this times the matched suffix's length in tokens", float)
    min_prob: float = option(0.1, "propose only continuations whose estimated probability is at least this", float)
    history_tokens: int = option(
        1 << 16,  # memory grows with it, by a few nodes a token in ordinary text
        "generated tokens of earlier and concurrent generations that the shared suffix tree keeps (the older half "
        "dropped when full; 0: none, which makes seeded sampling reproducible whatever ran before)",
    )


@dataclass(frozen=True)
class SuffixMethodOptions(SuffixOptions):
    """Suffix decoding as a method: a chain, or a tree of tree_tokens; EAGLE's head or the draft model where the match
    is short."""

    tree_tokens: int | None = _tree_tokens()
    eagle_below: int | None = option(
        None,
        "draft with the EAGLE head (--head, default the shipped one) on steps whose best suffix match is shorter "
        "than this many tokens (SAM-Decoding's combination)",
    )
    draft_below: int | None = option(
        None,
        "draft with the draft model (--draft) on steps whose best suffix match is shorter than this many tokens, a "
        "chain as deep (SAM-Decoding's combination with a draft model)",
    )
    vocab_map: str | None = _vocab_map()

    def default_k(self) -> int | str | None:
        return AUTO if self.tree_tokens is None else SUFFIX_K  # a chain cut by its own estimates; a tree stays fixed


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa heads: a tree shaped by their measured accuracy; k is the number of heads."""

    tree_tokens: int = option(TREE_TOKENS, "nodes of the tree the target verifies")
    draft_vocab: int | None = _draft_vocab()

    def default_k(self) -> int | str | None:
        return None


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
