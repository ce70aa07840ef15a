"""`verispec bench` end to end: load, time the primitives, run the suite, summarize, write the report."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from verispec.bench.costs import timing
from verispec.bench.layer_skip_search import search_skip, write_plan
from verispec.bench.llamacpp import BINARIES, llama_cpp_methods
from verispec.bench.methods import (
    BenchMethod,
    our_methods,
    ours,
    transformers_methods,
    unrelated_label,
    unrelated_methods,
)
from verispec.bench.report import floor_line, machine, write_report
from verispec.bench.runner import run_suite
from verispec.bench.suite import SUITE, check_items, read_suite
from verispec.bench.summary import BASELINE, summarize
from verispec.checkpoints.chat_template import load_chat_template
from verispec.checkpoints.draft_vocab import default_size, head_section
from verispec.checkpoints.random_init import random_pair, tiny_config, unrelated_draft
from verispec.drafters import DraftModel
from verispec.drafters.cross_vocab import INTERSECTION, same_tokenizer, translation_for
from verispec.drafters.layer_skip import PLAN_FILE, LayerSkip
from verispec.drafters.registry import Method, Resources, build_drafter, method_named, resolve_method
from verispec.errors import InvalidArgumentError
from verispec.generate import generate
from verispec.grammar import Grammar, bind
from verispec.heads.eagle import EagleHead, head_config, save_head
from verispec.heads.medusa import MedusaHeads, save_heads
from verispec.models.native import NativeModel, load_model
from verispec.models.precision import DEFAULT_DTYPE, formats
from verispec.models.twin import twin_refusal
from verispec.spec_bench import MAX_NEW_TOKENS as SPEC_BENCH_TOKENS
from verispec.spec_bench import is_spec_bench, parsed, turn_prompts
from verispec.stats import peak_resident_bytes
from verispec.threads import torch_threads
from verispec.vocab_map import shared_tokens, token_table


def prompts_for(target: NativeModel, suite: list[dict]) -> list[tuple[dict, list[int]]]:
    """Token ids of each prompt, cut from the left when prompt and answer would not fit the context (a Spec-Bench
    turn's, `prompt_ids`, fit as they are); an item with a `json_schema` gets it compiled for the target, once, as its
    `grammar`."""
    out = []
    for item in suite:
        if "prompt_ids" in item:
            out.append((item, item["prompt_ids"]))
            continue
        ids = target.tokenizer.encode(item["prompt"], add_special_tokens=True).ids
        if "json_schema" in item:
            item = item | {"grammar": bind(Grammar.json_schema(item["json_schema"]), target)}
        out.append((item, ids[-(target.context_length - item["max_new_tokens"] - 1) :]))
    return out


def float64_check(
    target_dir: Path, draft_dir: Path | None, prompts: list[tuple[dict, list[int]]], count: int = 8
) -> dict:
    """Greedy speculation against autoregressive decoding with every model in float64, on `count` prompts:
    where rounding cannot flip a near-tie, the outputs must be identical. With a draft, the draft model at k = 4
    (among the shared tokens for a draft with another tokenizer); without one, suffix decoding, which needs no
    training. The `count` shortest prompts: a float64 prefill of a long one costs minutes on a real model."""
    target = load_model(target_dir, dtype="float64")
    if draft_dir is None:
        method = resolve_method(Method("suffix"))
        label, drafter = method.label, build_drafter(method, Resources(target=target))
    else:
        draft = load_model(draft_dir, dtype="float64")
        cross = not same_tokenizer(target, draft)
        label = "draft k=4" + (" vocab_map=intersection" if cross else "")
        drafter = DraftModel(draft, 4, translation=translation_for(target, draft, INTERSECTION) if cross else None)
    chosen = sorted(prompts, key=lambda prompt: len(prompt[1]))[:count]
    same = sum(
        generate(target, ids, drafter, max_new_tokens=item["max_new_tokens"], ignore_eos=True).tokens
        == generate(target, ids, max_new_tokens=item["max_new_tokens"], ignore_eos=True).tokens
        for item, ids in chosen
    )
    return {"method": label, "prompts": len(chosen), "exact_match": same / len(chosen)}


def _record(row: BenchMethod) -> dict | None:
    """A row's method record for results.json (None for a peer): what `auto` chose says why too."""
    if row.method is None:
        return None
    method = row.method
    why = {} if method.reason is None else {"reason": method.reason}
    return (
        {"family": method.family, "k": method.k, "options": method.options}
        | why
        | ({"unrelated": True} if row.unrelated else {})
    )


def vocab_overlap(target: NativeModel, draft: NativeModel, records: list[dict]) -> dict | None:
    """For a draft with another tokenizer: the tokens both vocabularies share, as a share of the target's, and the
    share of the target's own answers (the baseline's tokens) that are shared tokens, which bounds what drafting among
    them can propose; None where a tokenizer's tokens cannot be read as bytes."""
    tables = token_table(target.tokenizer), token_table(draft.tokenizer)
    if None in tables:
        return None
    shared = shared_tokens(*tables, target.vocab_size, draft.vocab_size)
    answers = [t for r in records if r["method"] == BASELINE and r["repeat"] == 0 for t in r["tokens"]]
    return {
        "shared": len(shared),
        "target_vocab": target.vocab_size,
        "draft_vocab": draft.vocab_size,
        "share_of_target": len(shared) / target.vocab_size,
        "answer_tokens_shared": shared.covered(answers),
    }


@dataclass(frozen=True)
class BenchOptions:
    """How `run_bench` runs. Everything at a fixed thread count (one by default: at batch one on a shared 2-core
    machine, a second thread mostly waits at barriers). `exact`: our models in exact mode (the peers cannot be).
    `only`: the methods to run, by label. `head_dir`: an EAGLE head for the target, which adds the EAGLE rows;
    `medusa_dir`: Medusa heads, which add the Medusa rows. `max_new_tokens`: each prompt's answer length (a
    Spec-Bench turn's: its plain greedy answer's, up to this).
    `unrelated`: also rows on a never-agreeing pair, the target with a draft of the draft's config and tokenizer but
    random weights (the same cost as the real draft; it agrees by chance). `llama_cpp`: llama.cpp's binaries, which
    add its rows as peers (bench/llamacpp.py). `dtype` may be "auto" (a GGUF target's own formats) and `quantize` a
    block format for the target's projections (`load_model`'s); the peers then run the target's resulting dtype, and
    llama.cpp the same blocks. A suite whose items carry a `json_schema` (data/bench/json.jsonl) is decoded under
    each one by every row, the baseline included (constrained plain decoding), to the schema's end; the peers and the
    unrelated pair, which take no grammar, do not run."""

    repeats: int = 3
    peers: bool = True
    progress: bool = True
    threads: int = 1
    float64_prompts: int = 8  # the float64 check's prompts (0: not run)
    dtype: str = DEFAULT_DTYPE
    chat_template: str | None = None  # Jinja text in place of the target's own, for a Spec-Bench suite's turns
    quantize: str | None = None
    exact: bool = False
    only: Sequence[str] | None = None
    head_dir: Path | None = None
    medusa_dir: Path | None = None
    unrelated: bool = False
    llama_cpp: Path | None = None
    max_new_tokens: int | None = None  # every prompt's, where given; a Spec-Bench turn's at most (default 1024)


def run_bench(
    target_dir: Path, draft_dir: Path | None, out: Path, suite: list[dict], options: BenchOptions = BenchOptions()
) -> dict:
    """Time every method on `suite`, write the report into `out`; returns the summary."""
    if any("json_schema" in item for item in suite):
        options = replace(options, peers=False, llama_cpp=None, unrelated=False)
    with torch_threads(options.threads), tempfile.TemporaryDirectory() as tmp:
        return _run(target_dir, draft_dir, out, suite, options, Path(tmp))


def _run(
    target_dir: Path,
    draft_dir: Path | None,
    out: Path,
    suite: list[dict],
    options: BenchOptions,
    work: Path,
) -> dict:
    """`run_bench`'s run, its files (the unrelated draft, llama.cpp's copies of a folder) in `work`."""
    dtype, exact, head_dir, only = options.dtype, options.exact, options.head_dir, options.only
    target = load_model(target_dir, dtype=dtype, exact=exact, quantize=options.quantize)
    draft = load_model(draft_dir, dtype=dtype) if draft_dir else None  # never exact: the target decides every token
    cross = draft is not None and not same_tokenizer(target, draft)  # a draft with another tokenizer
    dtype = str(target.dtype).removeprefix("torch.")  # what "auto" chose: the peers' float dtype
    plan = target_dir / PLAN_FILE
    skip = LayerSkip.from_checkpoint(target_dir).skip if plan.is_file() else None  # written by search-layerskip
    resources = Resources(draft, target_dir, target, head_dir, draft_dir)
    eagle_vocab = default_size(head_dir) if head_dir is not None else 0
    eagle_default = head_dir is not None and bool(head_section(head_dir).get("method"))  # the folder's own draft
    medusa = options.medusa_dir

    def given(method: Method) -> Resources:
        return replace(resources, head_dir=medusa) if method.family == "medusa" else resources

    defaults = our_methods(
        draft,
        layerskip=skip is not None,
        eagle=head_dir is not None,
        eagle_vocab=eagle_vocab,
        medusa=medusa is not None,
        eagle_default=eagle_default,
        medusa_vocab=default_size(medusa) if medusa is not None else 0,
        draft_vocab=default_size(draft_dir) if draft_dir is not None else 0,
        selfquant=twin_refusal(target) is None,
        skip=skip,
        cross=cross,
    )
    never = unrelated_methods(cross) if options.unrelated and draft_dir is not None else []
    # What --methods leaves out is never built: a drafter's twin or a peer's float copy of the target is gigabytes
    chosen, unrelated, wanted = _chosen(only, defaults, never, given, options.llama_cpp is not None)
    methods = [ours(target, method, given(method)) for method in chosen]
    unrelated_dir = unrelated_draft(draft_dir, work / "unrelated") if unrelated else None
    if unrelated:
        pair = Resources(load_model(unrelated_dir, dtype=dtype), target_dir, target, head_dir)
        methods += [ours(target, method, pair, unrelated=True) for method in unrelated]
    if options.peers and (wanted is None or any(label.startswith(TRANSFORMERS) for label in wanted)):
        methods += transformers_methods(target_dir, draft_dir, dtype=dtype, cross=cross)
    notes = []  # what could not run, and why: printed, and in the report
    if options.llama_cpp is not None and (wanted is None or any(label.startswith(LLAMA_CPP) for label in wanted)):
        rows, notes = llama_cpp_methods(
            options.llama_cpp,
            target_dir,
            None if cross else draft_dir,
            target,
            options.quantize or dtype,
            options.threads,
            work / "llama.cpp",
        )
        methods += rows
        notes += (
            [
                "llama.cpp speculative left out: its draft-model speculation needs the target's vocabulary, "
                "and this draft has another tokenizer"
            ]
            if cross
            else []
        )
    for note in notes if options.progress else ():
        print(f"note: {note}", flush=True)
    if wanted is not None:
        # (llama.cpp's rows that cannot run are left out with a note, above)
        missing = [
            label for label in wanted if label not in {m.label for m in methods} and not label.startswith(LLAMA_CPP)
        ]
        if missing:
            raise InvalidArgumentError(f"--methods names rows this bench has not: {', '.join(missing)}")
        methods = [m for m in methods if m.label in wanted]
    suite, questions = _turns(target, target_dir, suite, options.max_new_tokens, options.chat_template)
    times = timing(target, draft, methods, skip)
    if options.progress:
        print(floor_line(times))
    prompts = prompts_for(target, suite)
    records = run_suite({m.label: m.run for m in methods}, prompts, options.repeats, options.progress)
    summary = summarize(records, times["c"], times["r"], target.tokenizer.decode, times["trees"])
    summary = {m.label: summary[m.label] for m in methods}  # the methods' own order, not the runs' random one
    info = {
        "command": " ".join(["verispec", *sys.argv[1:]]) if sys.argv else "verispec bench",
        "machine": machine(),
        "peak_rss_mb": peak_resident_bytes() / 2**20,
        "repeats": options.repeats,
        "prompts": len(suite),
        "spec_bench": questions,
        "dtype": dtype,
        "formats": formats(target.module),
        "exact": exact,
        "notes": notes,
        "constrained": any("json_schema" in item for item in suite),
        "float64_check": float64_check(target_dir, draft_dir, prompts, options.float64_prompts)
        if options.float64_prompts
        else None,
        "vocab_overlap": vocab_overlap(target, draft, records) if cross else None,
        "target": str(target_dir),
        "draft": str(draft_dir),
        "unrelated_draft": "random weights, the draft's config and tokenizer" if unrelated_dir else None,
        "methods": {m.label: _record(m) for m in methods},
    }
    write_report(out, summary, records, times, info)
    return summary


TRANSFORMERS, LLAMA_CPP = "transformers ", "llama.cpp "  # the peers' rows' labels begin so


def _chosen(
    only: Sequence[str] | None,
    defaults: list[Method],
    unrelated: list[Method],
    given: Callable[[Method], Resources],
    llama_cpp: bool,
) -> tuple[list[Method], list[Method], set[str] | None]:
    """Our methods to build (`defaults`, or those `only` names, any other method too by its label: "suffix
    min_prob=0.3"), the unrelated pair's, and the labels of the rows asked for (None: every row); `llama_cpp`:
    whether llama.cpp's binaries were given."""
    if only is None:
        return defaults, unrelated, None
    labels = {
        resolve_method(method, given(method)).label: method for method in defaults
    }  # "suffix" runs "suffix k=auto"
    if "autoregressive" not in only:
        raise InvalidArgumentError(
            f'--methods must name the baseline "autoregressive"; the default rows here: {", ".join(labels)}'
        )
    never = {unrelated_label(m): m for m in unrelated}
    chosen, wanted = {}, set()
    for label in only:
        if label.startswith(LLAMA_CPP) and label.removeprefix(LLAMA_CPP) not in BINARIES:
            rows = ", ".join(LLAMA_CPP + kind for kind in BINARIES)
            raise InvalidArgumentError(f"--methods {label!r}: llama.cpp's rows are {rows}, with --llama-cpp DIR")
        if label.startswith(LLAMA_CPP) and not llama_cpp:
            raise InvalidArgumentError(f"--methods {label!r} needs llama.cpp's binaries: --llama-cpp DIR")
        if label.startswith((TRANSFORMERS, LLAMA_CPP)) or label in never:
            wanted.add(label)
            continue
        method = labels.get(label) or method_named(label)
        label = resolve_method(method, given(method)).label
        chosen.setdefault(label, method)
        wanted.add(label)
    return list(chosen.values()), [m for label, m in never.items() if label in wanted], wanted


def _turns(
    target: NativeModel, target_dir: Path, suite: list[dict], max_new_tokens: int | None, chat_template: str | None
) -> tuple[list[dict], dict | None]:
    """The suite's prompts: a Spec-Bench suite's questions become a prompt per turn, through the target's chat
    template or `chat_template` in its place (`verispec/spec_bench.py`), with a note of how; another suite's items as
    they are, at `max_new_tokens` if given."""
    if not is_spec_bench(suite):
        if chat_template is not None:
            raise InvalidArgumentError("a chat template renders a Spec-Bench suite's turns; this suite has prompts")
        check_items(suite)
        return suite if max_new_tokens is None else [item | {"max_new_tokens": max_new_tokens} for item in suite], None
    limit = SPEC_BENCH_TOKENS if max_new_tokens is None else max_new_tokens
    template = load_chat_template(target_dir, target.tokenizer, chat_template)
    items, skipped = turn_prompts(target, None if template is None else template.render, suite, limit)
    if not items:
        raise InvalidArgumentError(f"no question of the suite fits the context of {target.context_length} tokens")
    return items, {
        "questions": len(suite),
        "turns": len(items),
        "max_new_tokens": limit,
        "skipped": skipped,
        "parses": parsed(items),
    }


def quick_suite(per_category: int = 2, max_new_tokens: int = 16) -> list[dict]:
    suite, seen = [], {}
    for item in read_suite(SUITE):
        if seen.setdefault(item["category"], 0) < per_category:
            seen[item["category"]] += 1
            suite.append(item | {"max_new_tokens": max_new_tokens, "prompt": item["prompt"][-300:]})
    return suite


def run_quick(out: Path, progress: bool = True, threads: int = 1) -> dict:
    """Tiny random models and six short prompts: checks the machinery, not the speed (CI runs it)."""
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = random_pair(tmp, tiny_config(num_hidden_layers=3), draft_layers=1)
        # A short layer-skip search on two prompts of the suite, so the layerskip row runs too; at the bench's
        # thread count, since a thread that waits for a busy core stalls every barrier of a multi-threaded forward.
        with torch_threads(threads):
            texts = [item["prompt"] for item in quick_suite()[:2]]
            target = load_model(target_dir)
            write_plan(search_skip(target, texts, prompts=2, prompt_len=32, new_tokens=8), target_dir)
        torch.manual_seed(0)
        head = EagleHead(head_config(target.config))  # random: its rows check the machinery, not acceptance
        head_dir = save_head(head, Path(tmp) / "eagle", target_dir.name)
        medusa_dir = save_heads(
            MedusaHeads.from_target(target.lm_head_weight.detach().float(), 3), Path(tmp) / "medusa", target_dir.name
        )
        return run_bench(
            target_dir,
            draft_dir,
            out,
            quick_suite(),
            BenchOptions(  # float32: the peers' rows then decode our tokens, which the check holds them to
                repeats=2,
                progress=progress,
                threads=threads,
                dtype="float32",
                head_dir=head_dir,
                medusa_dir=medusa_dir,
                unrelated=True,
            ),
        )
