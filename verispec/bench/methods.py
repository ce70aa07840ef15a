"""What the benchmark runs: our loop with each drafter, and transformers' own generation as peers."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from verispec.drafters.base import Drafter
from verispec.drafters.cross_vocab import INTERSECTION, REENCODE
from verispec.drafters.eagle import EAGLE_TREE, EAGLE_TREE_DEPTH
from verispec.drafters.options import SUFFIX_K
from verispec.drafters.registry import AUTO, Method, Resources, build_drafter, resolve_method
from verispec.generate import generate
from verispec.grammar import TokenGrammar
from verispec.models.hf_adapter import pretrained_source
from verispec.models.native import NativeModel
from verispec.models.precision import parse_dtype

DRAFT_KS = (1, 2, 3, 4, 6, 8)
CROSS_KS = (2, 4, 6)  # a draft with another tokenizer: each way at these k and at auto


@dataclass
class Run:
    """One generation: what it produced, how long it took, and the loop's counters (zero for peers)."""

    tokens: list[int]
    seconds: float  # the whole generate() call, timed the same way for every method
    prefill_seconds: float = 0.0  # the target's prompt prefill inside it (ours, and llama.cpp's as it prints it)
    draft_seconds: float = 0.0  # drafting, verifying: where our loop's time goes (ours only)
    verify_seconds: float = 0.0
    target_calls: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    text: str | None = None  # a peer that prints text, not token ids (llama.cpp): its output, and `tokens` is empty


Runner = Callable[..., Run]  # (prompt ids, max_new_tokens); ours also take grammar=, for a suite of JSON schemas


@dataclass(frozen=True)
class BenchMethod:
    """A row of the report: our loop with a method record, or a transformers peer (`method` None)."""

    label: str
    run: Runner
    method: Method | None = None
    unrelated: bool = False  # drafted by a random draft of the real one's shape, which never agrees but by chance
    drafter: Drafter | None = None  # what `run` drafts with (None: autoregressive, or a peer), for the cost model


def ours(target: NativeModel, method: Method, resources: Resources, unrelated: bool = False) -> BenchMethod:
    """Our loop with `method` as it runs (`resolve_method`: the family's default k filled in, so that "suffix" and
    "suffix k=auto" are one row, labelled as the latter)."""
    method = resolve_method(method, resources)
    drafter = build_drafter(method, resources)  # a recipe: each generate() starts its own session

    def run(prompt: list[int], max_new_tokens: int, grammar: TokenGrammar | None = None) -> Run:
        """With a grammar (a JSON suite's rows), decoding is constrained and ends where the grammar does."""
        start = time.perf_counter()
        result = generate(
            target, prompt, drafter, max_new_tokens=max_new_tokens, ignore_eos=grammar is None, grammar=grammar
        )
        s = result.stats
        return Run(
            result.tokens,
            time.perf_counter() - start,
            s.prefill_time,
            s.draft_time,
            s.verify_time,
            s.target_calls,
            s.proposed_by_position,
            s.accepted_by_position,
        )

    return BenchMethod(unrelated_label(method) if unrelated else method.label, run, method, unrelated, drafter)


def unrelated_label(method: Method) -> str:
    """A row's label on the never-agreeing pair (`unrelated_methods`)."""
    return f"{method.family} (unrelated) k={method.k}"


# Suffix decoding as a tree as wide as its default chain is long; with EAGLE (SAM-Decoding's combination) on the steps
# whose match is shorter than 3 tokens, both 4 deep, as the EAGLE chain.
SUFFIX_TREE, SUFFIX_EAGLE = {"tree_tokens": 8}, {"eagle_below": 3}


def our_methods(
    draft: NativeModel | None,
    layerskip: bool = False,
    eagle: bool = False,
    eagle_vocab: int = 0,
    medusa: bool = False,
    medusa_vocab: int = 0,
    draft_vocab: int = 0,
    selfquant: bool = False,
    skip: Sequence[int] | None = None,
    eagle_default: bool = False,
    cross: bool = False,
) -> list[Method]:
    """The autoregressive baseline, the draft model at every k and as a tree (two candidates for the first token,
    each continued to depth 4), and every other family at k = 4 but suffix decoding (its default, the chain cut by
    auto, and its fixed depth as a chain and as a tree); the draft model and prompt lookup at k = auto too; layer
    skip (with the skip set of the target's layerskip.json) and EAGLE (a chain at k = 4 and auto, EAGLE-2's tree,
    and suffix decoding with EAGLE) and Medusa (its default tree) when asked. The draft model, EAGLE and Medusa each
    draft over the draft vocabulary their folder chooses (`draft_vocab`, `eagle_vocab`, `medusa_vocab` tokens, named
    in the label; 0: the full one), and then over the full one too (draft_vocab=0), for comparison. A draft with
    another tokenizer than the target's (`cross`) has instead the rows of `cross_methods`. `selfquant`: its default
    (what `--method selfquant` alone runs), and with the layers `skip` skipped too where a layer-skip plan gives
    them. `eagle_default`: the EAGLE head's folder names its default draft (verispec.method), which gets a row of
    its own, "eagle" (`--method eagle` alone)."""
    methods = [Method("autoregressive")]
    if draft is not None and cross:
        methods += cross_methods(draft_vocab)
    elif draft is not None:
        vocab = {"draft_vocab": draft_vocab} if draft_vocab else {}
        methods += [Method("draft", k, vocab) for k in (*DRAFT_KS, AUTO)] + [Method("draft", 4, {"branch": 2} | vocab)]
        if draft_vocab:
            methods.append(Method("draft", 4, {"draft_vocab": 0}))
    methods += [
        Method("ngram", 4),
        Method("ngram", AUTO),
        Method("suffix"),  # k=auto
        Method("suffix", SUFFIX_K),
        Method("suffix", None, SUFFIX_TREE),
    ]
    if layerskip:
        methods.append(Method("layerskip", 4))
    if selfquant:
        methods += [Method("selfquant", AUTO)] + ([Method("selfquant", AUTO, {"skip": list(skip)})] if skip else [])
    methods.append(Method("lookahead", None, {"window": 5, "ngram": 4, "candidates": 5}))
    if eagle:
        vocab = {"draft_vocab": eagle_vocab} if eagle_vocab else {}
        methods += [Method("eagle")] if eagle_default else []
        methods += [
            Method("eagle", AUTO, vocab),
            Method("eagle", 4, vocab),
            Method("eagle", EAGLE_TREE_DEPTH, EAGLE_TREE | vocab),
        ]
        if eagle_vocab:
            methods.append(Method("eagle", 4, {"draft_vocab": 0}))
        methods.append(Method("suffix", 4, SUFFIX_EAGLE))
    if medusa:
        methods.append(Method("medusa", None, {"draft_vocab": medusa_vocab} if medusa_vocab else {}))
        if medusa_vocab:
            methods.append(Method("medusa", None, {"draft_vocab": 0}))
    return methods


def cross_methods(draft_vocab: int = 0) -> list[Method]:
    """A draft with another tokenizer: drafting among the shared tokens and by re-encoding its text, each at CROSS_KS
    and at auto, over the draft vocabulary its folder chooses (`draft_vocab` tokens, 0: the full one); the
    intersection as a tree too (two candidates for the first token), and over the draft's full vocabulary."""
    vocab = {"draft_vocab": draft_vocab} if draft_vocab else {}
    methods = [
        Method("draft", k, {"vocab_map": way} | vocab) for way in (INTERSECTION, REENCODE) for k in (*CROSS_KS, AUTO)
    ]
    methods.append(Method("draft", 4, {"vocab_map": INTERSECTION, "branch": 2} | vocab))
    if draft_vocab:
        methods.append(Method("draft", 4, {"vocab_map": INTERSECTION, "draft_vocab": 0}))
    return methods


def unrelated_methods(cross: bool = False) -> list[Method]:
    """Rows on the never-agreeing pair: the draft model at k = 4 (what drafting costs when nothing is accepted) and
    at k = auto (which should stop drafting and stay within a few percent of autoregressive decoding); among the shared
    tokens for a draft with another tokenizer (`cross`)."""
    options = {"vocab_map": INTERSECTION} if cross else {}
    return [Method("draft", 4, options), Method("draft", AUTO, options)]


def transformers_methods(
    target_dir: Path, draft_dir: Path | None, k: int = 4, dtype: str = "float32", cross: bool = False
) -> list[BenchMethod]:
    """transformers' greedy generate, its assisted generation (its defaults, and at our k) and its prompt lookup
    (our n-gram sizes), on the same checkpoints; with a draft of another tokenizer (`cross`), its universal assisted
    generation, given both tokenizers. EOS is switched off as in our runs, so every method produces exactly
    max_new_tokens tokens of the same greedy continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes on generation arguments would interleave with the progress bar
    logging.disable_progress_bar()
    target = AutoModelForCausalLM.from_pretrained(**pretrained_source(target_dir), dtype=parse_dtype(dtype)).eval()
    assistant = (
        AutoModelForCausalLM.from_pretrained(**pretrained_source(draft_dir), dtype=parse_dtype(dtype)).eval()
        if draft_dir
        else None
    )

    config = copy.deepcopy(target.generation_config)
    config.eos_token_id, config.pad_token_id, config.do_sample = None, 0, False
    tokenizers = {}  # universal assisted generation re-encodes between the two
    if cross and assistant is not None:
        tokenizers = {
            "tokenizer": AutoTokenizer.from_pretrained(**pretrained_source(target_dir)),
            "assistant_tokenizer": AutoTokenizer.from_pretrained(**pretrained_source(draft_dir)),
        }

    def peer(label: str, **options) -> BenchMethod:
        @torch.inference_mode()
        def run(prompt: list[int], max_new_tokens: int) -> Run:
            ids = torch.tensor([prompt])
            start = time.perf_counter()
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                max_new_tokens=max_new_tokens,
                **options,
            )
            return Run(out[0, len(prompt) :].tolist(), time.perf_counter() - start)

        return BenchMethod(label, run)

    methods = [peer("transformers greedy")]
    if assistant is not None:
        assistant.generation_config.eos_token_id = None
        methods.append(peer("transformers assisted", assistant_model=assistant, **tokenizers))  # its defaults
        methods.append(
            peer(
                f"transformers assisted k={k}",
                assistant_model=assistant,
                num_assistant_tokens=k,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,
                **tokenizers,
            )
        )
    methods.append(peer("transformers prompt lookup", prompt_lookup_num_tokens=k, max_matching_ngram_size=3))
    return methods
