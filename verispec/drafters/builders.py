"""Each family's drafter, built from its option record (drafters/options.py), a draft length and the `Resources` it
builds from. k arrives resolved (registry.build_drafter): a number, or None where the family takes it from a
checkpoint (an EAGLE head's card, a layer-skip plan) or takes none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verispec.argument_checks import whole_number
from verispec.checkpoints.draft_vocab import head_draft_vocab, head_section
from verispec.checkpoints.shipped import default_head
from verispec.drafters.cross_vocab import translation_for
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.eagle import Eagle
from verispec.drafters.layer_skip import LayerSkip, read_plan
from verispec.drafters.lookahead import Lookahead
from verispec.drafters.medusa import Medusa
from verispec.drafters.ngram import PromptLookup
from verispec.drafters.options import (
    FIXED_K,
    DraftOptions,
    EagleOptions,
    LayerSkipOptions,
    LookaheadOptions,
    MedusaOptions,
    NgramOptions,
    SelfQuantOptions,
    SuffixMethodOptions,
)
from verispec.drafters.selfquant import SelfQuant, skip_option
from verispec.drafters.suffix import SuffixDecoding
from verispec.errors import CheckpointError, IncompatibleTargetError, InvalidArgumentError
from verispec.heads.eagle import load_head
from verispec.heads.eagle3 import is_eagle3, load_eagle3
from verispec.heads.medusa import load_heads
from verispec.models.protocol import CausalLM
from verispec.models.twin import TwinFormat


@dataclass(frozen=True)
class Resources:
    """What some families build from besides their options."""

    draft: CausalLM | None = None  # the draft model ("draft")
    target_dir: Path | None = None  # the target's folder or file: layerskip.json's folder, a shipped head's match
    target: CausalLM | None = None  # the target itself, whose shapes and dtype a head is loaded for ("eagle")
    head_dir: Path | None = None  # an EAGLE or Medusa head's folder (default: the one shipped for the target)
    draft_dir: Path | None = None  # the draft model's folder, where its draft vocabulary lies ("draft")


def draft(options: DraftOptions, k: int, res: Resources) -> DraftModel:
    if res.draft is None:
        raise InvalidArgumentError("method draft needs a draft model (--draft DIR)")
    size = None if options.draft_vocab is None else whole_number(options.draft_vocab, "draft_vocab", 0)
    vocab = None
    if size is None and res.draft_dir is not None and res.draft.capabilities.vocab_heads:
        vocab = _draft_vocab(options.draft_vocab, res.draft_dir)  # the folder's choice, where an LM head over it runs
    elif size:
        if res.draft_dir is None:
            raise InvalidArgumentError(
                "draft_vocab reads the draft's token frequencies from its folder, which is not known here"
            )
        vocab = _draft_vocab(size, res.draft_dir)
    translation = None
    if options.vocab_map is not None:
        if res.target is None:
            raise InvalidArgumentError("vocab_map maps the draft's tokens to the target's, which is not known here")
        translation = translation_for(res.target, res.draft, options.vocab_map, tree=options.branch > 1)
    return DraftModel(res.draft, k, options.branch, options.branch_depth, vocab, translation)


def ngram(options: NgramOptions, k: int, res: Resources) -> PromptLookup:
    return PromptLookup(k, options.max_ngram, options.min_ngram)


def layerskip(options: LayerSkipOptions, k: int | None, res: Resources) -> LayerSkip:
    if isinstance(options.skip, (str, Path)):  # a plan's file: its skip set, and its k unless one is given
        skip, planned = read_plan(options.skip)
        return LayerSkip(skip, planned if k is None else k)
    if options.skip is not None:
        return LayerSkip(options.skip, k)
    if res.target_dir is None:
        raise InvalidArgumentError(
            "method layerskip needs the layers to skip (skip) or the target's folder, "
            "where `verispec search-layerskip` wrote layerskip.json"
        )
    return LayerSkip.from_checkpoint(res.target_dir, k)


def selfquant(options: SelfQuantOptions, k: int, res: Resources) -> SelfQuant:
    if res.target is None:
        raise InvalidArgumentError("method selfquant needs the target to make its quantized twin of")
    spec = TwinFormat(options.format, options.head_format, tuple(skip_option(options.skip or ())))
    return SelfQuant(res.target, spec, k, options.branch, options.branch_depth)


def lookahead(options: LookaheadOptions, k: None, res: Resources) -> Lookahead:
    return Lookahead(options.window, options.ngram, options.candidates)


def eagle(options: EagleOptions, k: int | None, res: Resources) -> Eagle:
    _reads_features(res, "eagle")
    folder = res.head_dir or default_head(res.target_dir, "eagle")
    eagle3 = is_eagle3(folder)  # an EAGLE-3 head, with its own draft vocabulary
    head = (load_eagle3 if eagle3 else load_head)(folder, res.target.config, res.target.dtype, res.target.device)
    if eagle3 and options.draft_vocab:
        raise InvalidArgumentError(
            f"this EAGLE-3 head drafts over its own {len(head.own_vocab)}-token vocabulary; it takes no draft_vocab"
        )
    tree = options.tree_top_k, options.tree_tokens
    if k is None and tree == (None, None):  # the setting its card measured best
        k, tree = _head_default(folder)
    if (tree[0] is None) != (tree[1] is None):
        raise InvalidArgumentError(
            "an EAGLE tree takes both tree_top_k (nodes expanded per depth, children per "
            "node) and tree_tokens (nodes verified)"
        )
    vocab = None if eagle3 else _draft_vocab(options.draft_vocab, folder)
    return Eagle(head, FIXED_K if k is None else k, vocab, tree=None if tree[0] is None else tree)


def _head_default(folder: Path) -> tuple[int | None, tuple[int | None, int | None]]:
    """A head folder's default draft (config.json's verispec.method: k, and tree_top_k with tree_tokens for a tree):
    (k, (tree_top_k, tree_tokens)), None where the folder names none."""
    section = head_section(folder).get("method") or {}
    if not isinstance(section, dict) or not set(section) <= {"k", "tree_top_k", "tree_tokens"}:
        raise CheckpointError(f"{folder}/config.json: verispec.method names k, tree_top_k and tree_tokens only")
    return section.get("k"), (section.get("tree_top_k"), section.get("tree_tokens"))


def suffix(options: SuffixMethodOptions, k: int, res: Resources) -> SuffixDecoding:
    """Suffix decoding; with eagle_below or draft_below, EAGLE's head or the draft model drafts the steps without a
    long enough match, a chain as deep."""
    if options.eagle_below is not None and options.draft_below is not None:
        raise InvalidArgumentError("suffix drafts with one model where its match is short: eagle_below or draft_below")
    if options.vocab_map is not None and options.draft_below is None:
        raise InvalidArgumentError("suffix's vocab_map is its draft model's (with draft_below)")
    fallback, below = None, 0
    if options.eagle_below is not None:
        fallback, below = eagle(EagleOptions(), k, res), options.eagle_below
    elif options.draft_below is not None:
        fallback, below = draft(DraftOptions(vocab_map=options.vocab_map), k, res), options.draft_below
    return SuffixDecoding(k, options.tree_tokens, options, fallback, below)


def medusa(options: MedusaOptions, k: None, res: Resources) -> Medusa:
    _reads_features(res, "medusa")
    folder = res.head_dir or default_head(res.target_dir, "medusa")
    heads, accuracy = load_heads(
        folder, res.target.hidden_size, res.target.lm_head_weight.shape[0], res.target.dtype, res.target.device
    )
    return Medusa(heads, accuracy, options.tree_tokens, _draft_vocab(options.draft_vocab, folder))


def _draft_vocab(size: int | None, folder: Path):
    """A drafter's reduced draft vocabulary: `size` most frequent tokens (0: the full vocabulary, None), or by default
    (None) the one its folder chooses (see `head_draft_vocab`)."""
    return head_draft_vocab(folder, None if size is None else whole_number(size, "draft_vocab", 0))


def _reads_features(res: Resources, family: str) -> None:
    if res.target is None:
        raise InvalidArgumentError(f"method {family} needs the target to load its head for")
    if not res.target.capabilities.hidden_states:
        raise IncompatibleTargetError(
            f"method {family} reads the target's hidden states; {res.target.name} does "
            "not offer them (the native runtime does)"
        )
