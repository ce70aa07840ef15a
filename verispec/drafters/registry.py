"""The one place that builds a drafter from a method record: the CLI, the API, the bench and the server all use it.

A `Method` (drafters/options.py) is a family name, a draft length k and the family's options. k None is the family's
default (its option record's `default_k`); "auto" is chosen per step by `verispec.drafters.adaptive.AdaptiveK`, up to
AUTO_MAX_K for a chain, on or off at the family's default size for a tree or a window, cut by its own estimates for a
drafter that scores its tokens. The family "auto" is chosen for the target (drafters/choice.py). Adding a drafter
means adding its family here: its option record (drafters/options.py), its builder (drafters/builders.py) and what
it needs of the target.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from verispec.argument_checks import whole_number
from verispec.drafters import builders
from verispec.drafters.adaptive import AUTO_MAX_K, AdaptiveK
from verispec.drafters.base import Drafter, Needs
from verispec.drafters.builders import Resources
from verispec.drafters.choice import choose
from verispec.drafters.medusa import Medusa
from verispec.drafters.options import (
    AUTO,
    DraftOptions,
    EagleOptions,
    LayerSkipOptions,
    LookaheadOptions,
    MedusaOptions,
    Method,
    NgramOptions,
    NoOptions,
    Option,
    SelfQuantOptions,
    SuffixMethodOptions,
    described,
)
from verispec.errors import InvalidArgumentError
from verispec.models.protocol import FINAL


@dataclass(frozen=True)
class Family:
    summary: str
    options: type  # its option record (drafters/options.py): names, defaults, help
    build: Callable[[Any, int | None, Resources], Drafter | None]  # (options, k, resources); drafters/builders.py
    needs: Callable[[Any], Needs] = lambda options: Needs()  # of its options, known before anything is loaded
    takes_k: bool = True


FAMILIES: dict[str, Family] = {
    "autoregressive": Family(
        "plain decoding: one target forward per token", NoOptions, lambda o, k, r: None, takes_k=False
    ),
    "draft": Family(
        "a smaller model proposes (a chain, or a tree with branch > 1; draft_vocab: among that many "
        "frequent tokens, by an LM head over them, 0 for all, by default the draft's own; vocab_map: a "
        "draft with another tokenizer)",
        DraftOptions,
        builders.draft,
        lambda o: Needs(tree_masks=o.branch > 1),
    ),
    "ngram": Family("prompt lookup: what followed the text's last n-gram earlier", NgramOptions, builders.ngram),
    "layerskip": Family(
        "the target drafts for itself with some layers skipped",
        LayerSkipOptions,
        builders.layerskip,
        lambda o: Needs(layer_subsets=True),
    ),
    "selfquant": Family(
        "the target drafts for itself with its own weights requantized lower (its twin: projections "
        "in format, the LM head in head_format), with the layers skip skipped as well if given; a "
        "chain, or a tree with branch > 1",
        SelfQuantOptions,
        builders.selfquant,
        lambda o: Needs(tree_masks=o.branch > 1, twin=True),
    ),
    "lookahead": Family(
        "Jacobi iteration in the target's own forward guesses n-grams (k is ngram - 1)",
        LookaheadOptions,
        builders.lookahead,
        lambda o: Needs(tree_masks=True),
        takes_k=False,
    ),
    "eagle": Family(
        "a one-layer head drafts from the target's own features (EAGLE; a dynamic tree as in EAGLE-2 "
        "with tree_top_k and tree_tokens; draft_vocab: an LM head over that many frequent tokens, 0 for all, "
        "by default the head's own)",
        EagleOptions,
        builders.eagle,
        lambda o: Needs(hidden_states=(FINAL,), tree_masks=o.tree_top_k is not None),
    ),
    "suffix": Family(
        "SuffixDecoding: what most often followed the text's suffix, in this generation and earlier ones "
        "(suffix trees, no model; a chain of at most spec_factor x the match's length, or a tree of "
        "tree_tokens; eagle_below, draft_below: EAGLE's or the draft model's chain where the match is shorter)",
        SuffixMethodOptions,
        builders.suffix,
        lambda o: Needs(
            tree_masks=o.tree_tokens is not None, hidden_states=(FINAL,) if o.eagle_below is not None else ()
        ),
    ),
    "medusa": Family(
        "heads on the target's last feature guess the tokens after the next one; a tree of tree_tokens "
        "nodes shaped by their measured accuracy (k is the number of heads)",
        MedusaOptions,
        builders.medusa,
        lambda o: Medusa.needs,
        takes_k=False,
    ),
}


def _by_name() -> dict[str, Option]:
    """Every option by name, as the command line and a bench label give it: a name is parsed alike in every family."""
    options: dict[str, Option] = {}
    for family in FAMILIES.values():
        for name, (how, _) in described(family.options).items():
            options.setdefault(name, how)
    return options


OPTIONS = _by_name()


def families_taking(option: str) -> list[str]:
    """The families that take `option`, in FAMILIES' order."""
    return [name for name, family in FAMILIES.items() if option in described(family.options)]


def auto_k_families() -> list[str]:
    """The families that draft k=auto when given no k and no options."""
    return [name for name, family in FAMILIES.items() if family.options().default_k() == AUTO]


def option_help(name: str) -> str:
    """An option's help for the command line: the families that take it, what it does, and each one's default."""
    groups: dict[str, list[tuple[str, Any]]] = {}  # help -> (family, default as shown)
    for family in families_taking(name):
        how, default = described(FAMILIES[family].options)[name]
        groups.setdefault(how.help, []).append((family, how.default_text or default))
    parts = []
    for text, takers in groups.items():
        shown = {default for _, default in takers if default is not None}
        if len(shown) == 1 and all(default is not None for _, default in takers):
            text += f" (default: {shown.pop()})"
        elif shown:
            text += (
                " (default: "
                + "; ".join(f"{family} {default}" for family, default in takers if default is not None)
                + ")"
            )
        parts.append(f"{', '.join(family for family, _ in takers)}: {text}")
    return "; ".join(parts)


def check_method(method: Method) -> Needs:
    """Refuse an unknown family, an option it does not take, or a bad k, before anything is loaded; returns what
    the method needs of the target (so that an unsuitable backend is refused before loading, too). `auto` is checked
    once it has chosen (`resolve_method`)."""
    family = FAMILIES.get(method.family)
    if family is None:
        raise InvalidArgumentError(f"unknown method {method.family!r}; choose one of {AUTO}, {', '.join(FAMILIES)}")
    takes = described(family.options)
    unknown = sorted(set(method.options) - set(takes))
    if unknown:
        what = f"it takes {', '.join(takes)}" if takes else "it takes none"
        raise InvalidArgumentError(f"method {method.family} takes no option {', '.join(unknown)} ({what})")
    for name, value in method.options.items():
        choices = takes[name][0].choices
        if choices is not None and value not in choices:
            raise InvalidArgumentError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    needs = family.needs(family.options(**method.options))
    if method.k == AUTO:
        if method.family == "autoregressive":
            raise InvalidArgumentError("method autoregressive drafts nothing, so it takes no k, auto included")
        return needs
    if method.k is not None and not family.takes_k:
        extra = ": set ngram (N, --ngram-size) instead; it drafts N - 1" if method.family == "lookahead" else ""
        raise InvalidArgumentError(f"method {method.family} takes no k{extra}")
    if method.k is not None:
        whole_number(method.k, "k (tokens drafted per step)", 1)
    return needs


def resolve_method(method: Method, resources: Resources | None = None) -> Method:
    """`method` as it runs, checked: `auto`'s choice for the target (its `reason` says why), and the family's default
    k where none is given (None where the family reads it from a checkpoint or takes none)."""
    if method.family == AUTO:
        method = choose(method, resources or Resources())
    check_method(method)
    if method.k is not None:
        return method
    family = FAMILIES[method.family]
    return replace(method, k=family.options(**method.options).default_k())


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
            else:
                options[name] = OPTIONS[name].parse(text)
        except ValueError:
            raise InvalidArgumentError(
                f"method {label!r}: {part!r} is not k=N, k={AUTO} or an option's name=value "
                f"(options: {', '.join(OPTIONS)})"
            ) from None
    method = Method(family, k, options)
    if family != AUTO:
        check_method(method)
    return method


def build_drafter(method: Method, resources: Resources | None = None) -> Drafter | None:
    """The drafter for `method` (None for autoregressive decoding), with the family's defaults for what it leaves
    out (`resolve_method`)."""
    resources = resources or Resources()
    method = resolve_method(method, resources)
    family = FAMILIES[method.family]
    options = family.options(**method.options)
    if method.k != AUTO:
        return family.build(options, method.k, resources)
    # A chain may draft up to AUTO_MAX_K; a tree or a window keeps the family's default size, on or off (or, scored by
    # the drafter, cut: suffix decoding's).
    tree = family.needs(options).tree_masks or not family.takes_k
    return AdaptiveK(family.build(options, options.default_k() if tree else AUTO_MAX_K, resources))
