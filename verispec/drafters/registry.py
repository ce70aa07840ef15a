"""The one place that builds a drafter from a method record: the CLI, the bench and the server all use it.

A `Method` is a family name, a draft length k (None: the family's default; "auto": chosen per step by
`verispec.drafters.adaptive.AdaptiveK`, up to AUTO_MAX_K for a chain, on or off at the family's default size for a
tree or a window, cut by its own estimates for a drafter that scores its tokens) and the family's options. Adding a
drafter means adding its family here, with the options it takes and what it needs of the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from verispec.argument_checks import whole_number
from verispec.checkpoints.blocks import FORMATS
from verispec.checkpoints.draft_vocab import head_draft_vocab, head_section
from verispec.checkpoints.shipped import default_head
from verispec.drafters.adaptive import AUTO_MAX_K, AdaptiveK
from verispec.drafters.base import Drafter, Needs
from verispec.drafters.cross_vocab import WAYS, translation_for
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.eagle import Eagle
from verispec.drafters.layer_skip import LayerSkip, read_plan
from verispec.drafters.lookahead import Lookahead
from verispec.drafters.medusa import TREE_TOKENS, Medusa
from verispec.drafters.ngram import PromptLookup
from verispec.drafters.selfquant import SelfQuant, skip_option
from verispec.drafters.suffix import K as SUFFIX_K
from verispec.drafters.suffix import SuffixDecoding, SuffixOptions
from verispec.errors import CheckpointError, IncompatibleTargetError, InvalidArgumentError
from verispec.heads.eagle import load_head
from verispec.heads.eagle3 import is_eagle3, load_eagle3
from verispec.heads.medusa import load_heads
from verispec.models.protocol import FINAL, CausalLM
from verispec.models.twin import SAME_HEAD, TwinFormat


@dataclass(frozen=True)
class Method:
    """A decoding method as a record, e.g. Method("draft", 4, {"branch": 2})."""

    family: str
    k: int | str | None = None  # tokens drafted per step, None for the family's default, or AUTO
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """What reports and logs call it: "draft k=4 branch=2"."""
        parts = [self.family] + ([] if self.k is None else [f"k={self.k}"])
        return " ".join(parts + [f"{name}={_show(value)}" for name, value in self.options.items()])


@dataclass(frozen=True)
class Resources:
    """What some families build from besides their options."""

    draft: CausalLM | None = None  # the draft model ("draft")
    target_dir: Path | None = None  # the target's folder, where layerskip.json lies ("layerskip" without "skip")
    target: CausalLM | None = None  # the target itself, whose shapes and dtype a head is loaded for ("eagle")
    head_dir: Path | None = None  # an EAGLE or Medusa head's folder (default: the one shipped for the shipped target)
    draft_dir: Path | None = None  # the draft model's folder, where its draft vocabulary lies ("draft")


@dataclass(frozen=True)
class Option:
    """A drafter option, declared once: the command line's flag is made from it (verispec/cli/parser.py)."""

    help: str  # what it does, after the families that take it
    type: Callable[[str], Any] = int  # what the command line's text becomes
    flag: str | None = None  # the command line's name, where it is not --name-with-dashes
    choices: tuple[str, ...] | None = None  # the values it takes, where they are a few names

    def flag_for(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")


OPTIONS: dict[str, Option] = {
    "max_ngram": Option("longest n-gram matched (default 3)"),
    "min_ngram": Option("shortest n-gram matched (default 1)"),
    "window": Option("columns of the Jacobi window (W, default 5)"),
    "ngram": Option("n-gram size N, N - 1 tokens drafted (default 4)", flag="--ngram-size"),
    "candidates": Option("most n-grams verified per step (G, default 5)"),
    "skip": Option(
        "layers to skip, e.g. 2,3, or a layer-skip plan's file, e.g. PLAN.json (layerskip: default "
        "TARGET/layerskip.json; selfquant: none)",
        str,
    ),
    "format": Option(
        f"the twin's projections in this block format (default {TwinFormat.format})", str, choices=tuple(FORMATS)
    ),
    "head_format": Option(
        f"the twin's LM head in this block format, or {SAME_HEAD}: the target's own (default "
        f"{TwinFormat.head}; a target's head already in it is shared, not requantized)",
        str,
        choices=(*FORMATS, SAME_HEAD),
    ),
    "branch": Option(
        "candidates per node at the first --branch-depth depths; > 1 verifies a token tree (native "
        "runtime; default 1, a chain)"
    ),
    "branch_depth": Option("how many depths branch (default 1)"),
    "tree_top_k": Option(
        "draft EAGLE-2's dynamic tree, expanding this many nodes per depth with this many children "
        "each (with --tree-tokens)"
    ),
    "tree_tokens": Option("nodes of the tree the target verifies"),
    "suffix_depth": Option("the longest string the suffix trees index, match and continuation (default 24)"),
    "spec_factor": Option("propose at most this times the matched suffix's length in tokens (default 1.0)", float),
    "min_prob": Option("propose only continuations whose estimated probability is at least this (default 0.1)", float),
    "history_tokens": Option(
        "generated tokens of earlier and concurrent generations that the shared suffix tree "
        "keeps (the older half dropped when full; 0: none, which makes seeded sampling "
        "reproducible whatever ran before; default 65536)"
    ),
    "eagle_below": Option(
        "draft with the EAGLE head (--head, default the shipped one) on steps whose best suffix "
        "match is shorter than this many tokens (SAM-Decoding's combination)"
    ),
    "draft_vocab": Option(
        "draft over this many of the most frequent tokens only (a cheaper LM head; verification "
        "still scores them all); 0: all of them (default: the draft's or head's folder's own, 2048 "
        "for the shipped ones)"
    ),
    "vocab_map": Option(
        "a draft with another tokenizer than the target's: intersection drafts among the tokens "
        "both vocabularies share (lossless under greedy decoding and sampling; chains and trees), "
        "reencode re-encodes the draft's greedy text into the target's tokens (chains; lossless too, "
        "under sampling as a one-hot guess), auto picks the first that applies (nothing for the same "
        "tokenizer); default: the draft must have the target's tokenizer",
        str,
        choices=WAYS,
    ),
}


@dataclass(frozen=True)
class Family:
    summary: str
    options: tuple[str, ...]  # names in OPTIONS
    build: Callable[[Method, Resources], Drafter | None]
    needs: Callable[[Method], Needs] = lambda method: Needs()  # known before anything is loaded
    takes_k: bool = True


AUTO = "auto"


def _draft(method: Method, res: Resources) -> DraftModel:
    if res.draft is None:
        raise InvalidArgumentError("method draft needs a draft model (--draft DIR)")
    options = {name: value for name, value in method.options.items() if name not in ("draft_vocab", "vocab_map")}
    size = method.options.get("draft_vocab")
    size = None if size is None else whole_number(size, "draft_vocab", 0)
    vocab = None
    if size is None and res.draft_dir is not None and res.draft.capabilities.vocab_heads:
        vocab = _draft_vocab(method, res.draft_dir)  # the folder's choice, where an LM head over it runs
    elif size:
        if res.draft_dir is None:
            raise InvalidArgumentError(
                "draft_vocab reads the draft's token frequencies from its folder, which is not known here"
            )
        vocab = _draft_vocab(method, res.draft_dir)
    translation = None
    if "vocab_map" in method.options:
        if res.target is None:
            raise InvalidArgumentError("vocab_map maps the draft's tokens to the target's, which is not known here")
        translation = translation_for(
            res.target, res.draft, method.options["vocab_map"], tree=method.options.get("branch", 1) > 1
        )
    return DraftModel(res.draft, method.k or 4, vocab=vocab, translation=translation, **options)


def _layerskip(method: Method, res: Resources) -> LayerSkip:
    skip = method.options.get("skip")
    if isinstance(skip, (str, Path)):  # a plan's file: its skip set, and its k unless one is given
        skip, k = read_plan(skip)
        return LayerSkip(skip, method.k or k)
    if skip is not None:
        return LayerSkip(skip, method.k or 4)
    if res.target_dir is None:
        raise InvalidArgumentError(
            "method layerskip needs the layers to skip (skip) or the target's folder, "
            "where `verispec search-layerskip` wrote layerskip.json"
        )
    return LayerSkip.from_checkpoint(res.target_dir, method.k)


def _selfquant(method: Method, res: Resources) -> SelfQuant:
    if res.target is None:
        raise InvalidArgumentError("method selfquant needs the target to make its quantized twin of")
    options = method.options
    spec = TwinFormat(
        options.get("format", TwinFormat.format),
        options.get("head_format", TwinFormat.head),
        tuple(skip_option(options.get("skip", ()))),
    )
    return SelfQuant(res.target, spec, method.k or 4, options.get("branch", 1), options.get("branch_depth", 1))


def _eagle(method: Method, res: Resources) -> Eagle:
    _reads_features(res, "eagle")
    folder = res.head_dir or default_head(res.target_dir, "eagle")
    eagle3 = is_eagle3(folder)  # an EAGLE-3 head, with its own draft vocabulary
    head = (load_eagle3 if eagle3 else load_head)(folder, res.target.config, res.target.dtype, res.target.device)
    if eagle3 and method.options.get("draft_vocab"):
        raise InvalidArgumentError(
            f"this EAGLE-3 head drafts over its own {len(head.own_vocab)}-token vocabulary; it takes no draft_vocab"
        )
    if method.k is None and not {"tree_top_k", "tree_tokens"} & set(method.options):
        method = replace(method, **_head_default(folder, method))  # the setting its card measured best
    tree = method.options.get("tree_top_k"), method.options.get("tree_tokens")
    if (tree[0] is None) != (tree[1] is None):
        raise InvalidArgumentError(
            "an EAGLE tree takes both tree_top_k (nodes expanded per depth, children per "
            "node) and tree_tokens (nodes verified)"
        )
    vocab = None if eagle3 else _draft_vocab(method, folder)
    return Eagle(head, method.k or 4, vocab, tree=None if tree[0] is None else tree)


def _head_default(folder: Path, method: Method) -> dict:
    """A head folder's default draft (config.json's verispec.method: k, and tree_top_k with tree_tokens for a tree),
    as the fields of `method` it fills in; none where the folder names none."""
    section = head_section(folder).get("method") or {}
    if not isinstance(section, dict) or not set(section) <= {"k", "tree_top_k", "tree_tokens"}:
        raise CheckpointError(f"{folder}/config.json: verispec.method names k, tree_top_k and tree_tokens only")
    tree = {name: section[name] for name in ("tree_top_k", "tree_tokens") if name in section}
    return {"k": section.get("k"), "options": method.options | tree}


def _suffix(method: Method, res: Resources) -> SuffixDecoding:
    options = {name: value for name, value in method.options.items() if name in SuffixOptions.__dataclass_fields__}
    fallback, below = None, method.options.get("eagle_below", 0)
    if "eagle_below" in method.options:  # EAGLE drafts the steps without a long enough match, a chain as deep
        fallback = _eagle(Method("eagle", method.k or SUFFIX_K), res)
    return SuffixDecoding(
        method.k or SUFFIX_K, method.options.get("tree_tokens"), SuffixOptions(**options), fallback, below
    )


def _medusa(method: Method, res: Resources) -> Medusa:
    _reads_features(res, "medusa")
    folder = res.head_dir or default_head(res.target_dir, "medusa")
    heads, accuracy = load_heads(
        folder, res.target.hidden_size, res.target.lm_head_weight.shape[0], res.target.dtype, res.target.device
    )
    return Medusa(heads, accuracy, method.options.get("tree_tokens", TREE_TOKENS), _draft_vocab(method, folder))


def _draft_vocab(method: Method, folder: Path):
    """The reduced draft vocabulary of a drafter's method: `draft_vocab` most frequent tokens (0: the full
    vocabulary, None), or by default the one its folder chooses (see `head_draft_vocab`)."""
    size = method.options.get("draft_vocab")
    return head_draft_vocab(folder, None if size is None else whole_number(size, "draft_vocab", 0))


def _reads_features(res: Resources, family: str) -> None:
    if res.target is None:
        raise InvalidArgumentError(f"method {family} needs the target to load its head for")
    if not res.target.capabilities.hidden_states:
        raise IncompatibleTargetError(
            f"method {family} reads the target's hidden states; {res.target.name} does "
            "not offer them (the native runtime does)"
        )


FAMILIES: dict[str, Family] = {
    "autoregressive": Family("plain decoding: one target forward per token", (), lambda m, r: None, takes_k=False),
    "draft": Family(
        "a smaller model proposes (a chain, or a tree with branch > 1; draft_vocab: among that many "
        "frequent tokens, by an LM head over them, 0 for all, by default the draft's own; vocab_map: a "
        "draft with another tokenizer)",
        ("branch", "branch_depth", "draft_vocab", "vocab_map"),
        _draft,
        lambda m: Needs(tree_masks=m.options.get("branch", 1) > 1),
    ),
    "ngram": Family(
        "prompt lookup: what followed the text's last n-gram earlier",
        ("max_ngram", "min_ngram"),
        lambda m, r: PromptLookup(m.k or 4, **m.options),
    ),
    "layerskip": Family(
        "the target drafts for itself with some layers skipped",
        ("skip",),
        _layerskip,
        lambda m: Needs(layer_subsets=True),
    ),
    "selfquant": Family(
        "the target drafts for itself with its own weights requantized lower (its twin: projections "
        "in format, the LM head in head_format), with the layers skip skipped as well if given; a "
        "chain, or a tree with branch > 1",
        ("format", "head_format", "skip", "branch", "branch_depth"),
        _selfquant,
        lambda m: Needs(tree_masks=m.options.get("branch", 1) > 1, twin=True),
    ),
    "lookahead": Family(
        "Jacobi iteration in the target's own forward guesses n-grams (k is ngram - 1)",
        ("window", "ngram", "candidates"),
        lambda m, r: Lookahead(**m.options),
        lambda m: Needs(tree_masks=True),
        takes_k=False,
    ),
    "eagle": Family(
        "a one-layer head drafts from the target's own features (EAGLE; a dynamic tree as in EAGLE-2 "
        "with tree_top_k and tree_tokens; draft_vocab: an LM head over that many frequent tokens, 0 for all, "
        "by default the head's own)",
        ("tree_top_k", "tree_tokens", "draft_vocab"),
        _eagle,
        lambda m: Needs(hidden_states=(FINAL,), tree_masks="tree_top_k" in m.options),
    ),
    "suffix": Family(
        "SuffixDecoding: what most often followed the text's suffix, in this generation and earlier ones "
        "(suffix trees, no model; a chain of at most spec_factor x the match's length, or a tree of "
        "tree_tokens; eagle_below: EAGLE's chain where the match is shorter)",
        ("tree_tokens", "suffix_depth", "spec_factor", "min_prob", "history_tokens", "eagle_below"),
        _suffix,
        lambda m: Needs(
            tree_masks="tree_tokens" in m.options, hidden_states=(FINAL,) if "eagle_below" in m.options else ()
        ),
    ),
    "medusa": Family(
        "heads on the target's last feature guess the tokens after the next one; a tree of tree_tokens "
        "nodes shaped by their measured accuracy (k is the number of heads)",
        ("tree_tokens", "draft_vocab"),
        _medusa,
        lambda m: Medusa.needs,
        takes_k=False,
    ),
}


def families_taking(option: str) -> list[str]:
    """The families that take `option`, in FAMILIES' order."""
    return [name for name, family in FAMILIES.items() if option in family.options]


def check_method(method: Method) -> Needs:
    """Refuse an unknown family, an option it does not take, or a bad k, before anything is loaded; returns what
    the method needs of the target (so that an unsuitable backend is refused before loading, too)."""
    family = FAMILIES.get(method.family)
    if family is None:
        raise InvalidArgumentError(f"unknown method {method.family!r}; choose one of {', '.join(FAMILIES)}")
    unknown = sorted(set(method.options) - set(family.options))
    if unknown:
        takes = f"it takes {', '.join(family.options)}" if family.options else "it takes none"
        raise InvalidArgumentError(f"method {method.family} takes no option {', '.join(unknown)} ({takes})")
    for name, value in method.options.items():
        choices = OPTIONS[name].choices
        if choices is not None and value not in choices:
            raise InvalidArgumentError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if method.k == AUTO:
        if method.family == "autoregressive":
            raise InvalidArgumentError("method autoregressive drafts nothing, so it takes no k, auto included")
        return family.needs(method)
    if method.k is not None and not family.takes_k:
        extra = ": set ngram (N, --ngram-size) instead; it drafts N - 1" if method.family == "lookahead" else ""
        raise InvalidArgumentError(f"method {method.family} takes no k{extra}")
    if method.k is not None:
        whole_number(method.k, "k (tokens drafted per step)", 1)
    return family.needs(method)


def method_named(label: str) -> Method:
    """The method a label names, as `Method.label` writes it ("suffix k=auto min_prob=0.3"), checked."""
    family, *parts = label.split() or [""]
    k, options = None, {}
    for part in parts:
        name, _, text = part.partition("=")
        try:
            if not text or name != "k" and name not in OPTIONS:
                raise ValueError
            if name == "k":
                k = text if text == AUTO else int(text)
            elif name == "skip" and not text.endswith(".json"):  # else a plan's file
                options[name] = [int(layer) for layer in text.split(",")]
            else:
                options[name] = OPTIONS[name].type(text)
        except ValueError:
            raise InvalidArgumentError(
                f"method {label!r}: {part!r} is not k=N, k={AUTO} or an option's name=value "
                f"(options: {', '.join(OPTIONS)})"
            ) from None
    method = Method(family, k, options)
    check_method(method)
    return method


def build_drafter(method: Method, resources: Resources = Resources()) -> Drafter | None:
    """The drafter for `method` (None for autoregressive decoding)."""
    check_method(method)
    family = FAMILIES[method.family]
    if method.k != AUTO:
        return family.build(method, resources)
    # A chain may draft up to AUTO_MAX_K; a tree or a window keeps the family's default size, on or off (or, scored by
    # the drafter, cut: suffix decoding's).
    tree = family.needs(method).tree_masks or not family.takes_k
    return AdaptiveK(family.build(replace(method, k=None if tree else AUTO_MAX_K), resources))


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
