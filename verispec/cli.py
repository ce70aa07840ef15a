"""Command line: running the commands of `verispec/cli_parser.py` and printing; everything they do is in the
Python API."""

from __future__ import annotations

import argparse
import codecs
import itertools
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from verispec.drafters.base import Drafter, Needs
from verispec.arguments import whole_number
from verispec.cli_output import GREEN, RESET, print_stream, stats_lines, turn_line, use_color
from verispec.cli_parser import build_parser
from verispec.drafters.registry import AUTO, OPTIONS, Method, Resources, build_drafter, check_method
from verispec.errors import InvalidArgumentError, UnsupportedArchitectureError, VerispecError
from verispec.chat import Chat
from verispec.generate import generate, stream
from verispec.grammar import Grammar, grammar_option
from verispec.models.auto import load
from verispec.models.protocol import CausalLM
from verispec.models.default import DEFAULT_TARGET, MODELS, default_paths, shipped_head_for
from verispec.models.gguf_file import is_gguf
from verispec.models.native import auto_dtype, load_model, own_kernels_run
from verispec.models.random_init import random_pair, tiny_config
from verispec.sampling import SamplingParams
from verispec.serve.chat import WHERE_TEMPLATES_LIVE, ChatTemplate, load_chat_template
from verispec.stats import GenerationStats
from verispec.threads import set_threads, torch_threads



def _method(args: argparse.Namespace) -> Method:
    """The method record from the command line: only the options that were given."""
    options = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    if "skip" in options:
        options["skip"] = _whole_numbers(options["skip"], "--skip", "layer indices such as 2,3")
    k = _k_arg(args.k)
    if args.method == "draft" and not args.draft and not options:  # --target alone decodes plainly
        return Method("autoregressive", k)
    chain = options.get("branch", 1) == 1 and "tree_top_k" not in options
    if k is None and chain and args.method in AUTO_BY_DEFAULT:
        k = AUTO
    return Method(args.method, k, options)


# Chains whose draft length auto chooses step by step. Not EAGLE's: on the shipped pair its auto drafted shorter than
# it should, below a fixed k = 4 in the bench's report.
AUTO_BY_DEFAULT = ("draft", "ngram")


def _k_arg(text: str | None) -> int | str | None:
    """-k: a whole number (checked by the registry, with the other options) or auto."""
    if text is None or text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"-k takes a whole number of tokens or auto, got {text!r}") from None


def _generate(args: argparse.Namespace) -> int:
    args.prompt = _read_prompt(args)
    args.stop = [_unescape(stop, "--stop") for stop in args.stop]
    _check_options(args)
    set_threads(args.threads)
    grammar = _grammar(args)
    target, drafter = _load_models(args, _checked_method(args))
    options = _decoding_options(args) | {"grammar": grammar}  # --compare decodes under the same grammar
    prompt = args.prompt  # --chat: the message as the template's one user turn, after the system message if any
    if args.chat:
        turn = [*([{"role": "system", "content": args.system}] if args.system else []),
                {"role": "user", "content": args.prompt}]
        prompt = target.tokenizer.encode(_chat_template(args).render(turn), add_special_tokens=False).ids
    if args.compare:  # warm both paths up first, so that neither timing pays torch's first-call costs
        for warm in (drafter, None):
            generate(target, prompt, warm, **(options | dict(max_new_tokens=min(8, args.max_new_tokens))))
    color = use_color(args.color)
    steps = stream(target, prompt, drafter, **options)  # validates every option
    try:
        print_stream(steps, color, "" if args.chat else args.prompt)
    except KeyboardInterrupt:  # Ctrl-C: the counts so far, on a line of their own
        steps.close()  # rolls the caches back and stops the clock; steps.stats keeps the partial counts
        print("\n")
        print("\n".join(stats_lines(steps.stats, "interrupted")), flush=True)
        return 130
    result = steps.result
    print("\n")
    if color and drafter:
        print(f"({GREEN}green{RESET}: accepted draft tokens; plain: the target's own)")
    print("\n".join(stats_lines(result.stats, result.stop_reason)))
    if args.compare:  # both timed the same way, without printing, one after the other
        spec_time = generate(target, prompt, drafter, **options).stats.total_time
        plain = generate(target, prompt, None, **options)
        print(f"autoregressive: {plain.stats.new_tokens} tokens in {plain.stats.total_time:.3f} s "
              f"({plain.stats.tokens_per_second:.1f} tok/s); speedup {plain.stats.total_time / spec_time:.2f}x")
        note = "" if SamplingParams(args.temperature).greedy else " (sampling: same distribution, not the same draws)"
        print(f"identical to autoregressive: {'yes' if plain.tokens == result.tokens else 'no'}{note}")
    return 0


def _decoding_options(args: argparse.Namespace) -> dict:
    """`stream`'s options from the command line (generate, chat)."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _chat_template(args: argparse.Namespace) -> ChatTemplate:
    """The target checkpoint's own chat template; one without refuses chat rather than guess a format."""
    template = load_chat_template(Path(args.target))
    if template is None:
        raise InvalidArgumentError(f"{args.target} has no chat template ({WHERE_TEMPLATES_LIVE}): chat needs the "
                                   "model's own; give `verispec generate` a plain prompt instead")
    return template


def _chat(args: argparse.Namespace) -> int:
    """A multi-turn conversation on the terminal: one line a message, /reset starts over, Ctrl-D quits; Ctrl-C ends
    the reply being written."""
    args.stop = [_unescape(stop, "--stop") for stop in args.stop]
    _check_options(args)
    set_threads(args.threads)
    method = _checked_method(args)  # (fills in the shipped pair)
    template = _chat_template(args)  # before seconds of loading
    target, drafter = _load_models(args, method)
    chat, color = Chat(target, template.render, drafter, system=args.system, **_decoding_options(args)), \
        use_color(args.color)
    print("verispec chat: one line a message; /reset starts over, Ctrl-D quits", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if line == "/reset":
            chat.reset()
            print("(a new conversation)")
            continue
        if not line:
            continue
        steps = None
        try:
            steps = chat.say(line)
            print_stream(steps, color)
        except KeyboardInterrupt:
            if steps is None:
                continue
            steps.close()  # the reply so far joins the conversation
        except VerispecError as err:
            print(f"verispec: error: {err}", file=sys.stderr, flush=True)
            continue
        print(f"\n{turn_line(steps.stats)}", flush=True)


def _checked_method(args: argparse.Namespace) -> Method:
    """The method record of `add_model_args`' options, checked before any model loads; fills in the shipped pair
    where no --target was given."""
    given_draft = args.draft
    if args.target is None:  # the shipped default pair
        args.target, default_draft = default_paths()
        args.draft = args.draft or default_draft
    method = _method(args)
    needs = check_method(method)  # before loading anything
    if given_draft and method.family != "draft":  # only --method draft loads it
        raise InvalidArgumentError(f"--draft is the draft model of --method draft; --method {args.method} would "
                                   "ignore it")
    if args.head and method.family not in ("eagle", "medusa") and "eagle_below" not in method.options:
        raise InvalidArgumentError(f"--head is the head of --method eagle or medusa (or suffix with --eagle-below); "
                                   f"--method {args.method} would ignore it")
    if args.backend == "transformers" and needs != Needs():
        raise InvalidArgumentError(f"method {method.label} needs the native runtime (tree masks, hidden states or "
                                   f"layer subsets); --backend transformers offers none of them")
    return method


def _load_target(args: argparse.Namespace) -> CausalLM:
    """The target, in exact mode if --exact. Without --exact or --no-exact, `generate` takes exact mode where the
    native runtime runs the target on verispec's kernels (there it costs nothing); the server never does (its
    batched engine needs ordinary forwards). A target that only transformers runs takes float32 where --dtype was
    left at auto (its bfloat16 has none of those kernels)."""
    auto_exact = args.exact is None and args.command == "generate"
    if args.backend == "transformers" or not (auto_exact or args.auto_dtype):
        return load(args.target, args.backend, args.device, args.dtype, exact=bool(args.exact), quantize=args.quantize)
    exact = own_kernels_run(args.dtype, args.device) if auto_exact else bool(args.exact)
    try:
        return load(args.target, "native", args.device, args.dtype, exact=exact, quantize=args.quantize)
    except UnsupportedArchitectureError:
        if args.backend == "native" or args.exact or args.quantize:
            raise
        # auto's own fallback (it says what both runtimes made of the folder), at no exact mode
        return load(args.target, "auto", args.device, "float32" if args.auto_dtype else args.dtype)


def _load_models(args: argparse.Namespace, method: Method) -> tuple[CausalLM, Drafter | None]:
    """The target and the method's drafter (None: plain decoding), from `add_model_args`' and `add_runtime_args`'
    options."""
    target = _load_target(args)
    draft = None
    if method.family == "draft" and args.draft:  # never exact: the target decides every token
        draft = load(args.draft, args.backend, args.device, args.dtype)
    head = Path(args.head) if args.head else None
    draft_dir = Path(args.draft) if draft is not None else None
    return target, build_drafter(method, Resources(draft, Path(args.target), target, head, draft_dir))


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt argument, stdin for `-`, or --prompt-file: exactly one of them, and not empty."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise InvalidArgumentError("give the prompt as an argument, as - to read stdin, or with --prompt-file FILE "
                                   "(exactly one)")
    source = "stdin" if args.prompt == "-" else args.prompt_file
    if args.prompt_file is not None:
        text = _read_file(args.prompt_file, "--prompt-file")
    else:
        try:
            text = sys.stdin.read() if args.prompt == "-" else args.prompt
        except UnicodeDecodeError:
            raise InvalidArgumentError("the prompt from stdin is not UTF-8 text") from None
    if not text:
        raise InvalidArgumentError("the prompt is empty" + (f" ({source})" if source else ""))
    return text


def _read_file(path: str, option: str) -> str:
    """A UTF-8 text file that an option names, read whole."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidArgumentError(f"{option} {path}: no such file") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{option} {path}: not UTF-8 text") from None


def _grammar(args: argparse.Namespace) -> Grammar | None:
    """What --json-schema FILE, --regex R or --grammar FILE (Lark or GBNF) ask the output to follow, compiled before
    any model loads (a bad schema costs no loading)."""
    read = lambda path, option: None if path is None else _read_file(path, option)
    return grammar_option(read(args.json_schema, "--json-schema"), args.regex, read(args.grammar, "--grammar"))


# The escapes of a Python string literal (group 1); any other backslash (group 2) is refused rather than guessed.
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[^}]*\}|[0-7]{1,3}|[\\'\"abfnrtv])"
                     r"|\\(.?)", re.DOTALL)


def _unescape(text: str, option: str) -> str:
    """Decode backslash escapes (\\n, \\t, \\\\, \\xNN, \\uNNNN, \\N{name} ...) one at a time: "unicode_escape" over the
    whole string would read its non-ASCII characters as Latin-1 bytes (é would come back as Ã©)."""

    def one(match: re.Match) -> str:
        try:
            char = codecs.decode(match.group(0), "unicode_escape") if match.group(1) else None
        except UnicodeDecodeError:  # \\N{no such name}, \\U beyond U+10FFFF
            char = None
        if char is None or 0xD800 <= ord(char) <= 0xDFFF:  # a lone surrogate cannot be in any decoded text
            raise InvalidArgumentError(f"{option} '{text}': bad escape '{match.group(0)}' (known: \\n \\t \\r \\\\ "
                                       f"\\' \\\" \\a \\b \\f \\v \\0-\\777 \\xNN \\uNNNN \\UNNNNNNNN \\N{{name}})")
        return char

    return _ESCAPE.sub(one, text)


def _check_options(args: argparse.Namespace) -> None:
    """Options outside the method record that need no model to judge: checked before seconds of loading."""
    if args.max_new_tokens < 1:
        raise InvalidArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.system is not None and args.command == "generate" and not args.chat:
        raise InvalidArgumentError("--system goes with --chat (or `verispec chat`): a plain prompt has no roles")
    SamplingParams(args.temperature, args.top_k, args.top_p)  # raises on a bad temperature, top-k or top-p


def _whole_numbers(text: str, option: str, what: str = "whole numbers such as 1,4,16") -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"{option} takes comma-separated {what}; got {text!r}") from None


def _serve(args: argparse.Namespace) -> None:
    from verispec.serve.app import serving_app  # FastAPI and uvicorn load on demand
    from verispec.serve.server import check_server_options, run_server
    from verispec.serve.options import ServeOptions, allowed_hosts, api_key

    check_server_options(args.port, args.shutdown_grace, args.max_batch)
    options = ServeOptions(api_key(args.api_key), allowed_hosts(args.host, args.allowed_hosts), not args.no_docs,
                           args.max_body_bytes, args.health_stall)
    set_threads(args.threads)
    method = _checked_method(args)
    target, drafter = _load_models(args, method)
    app = serving_app(target, drafter, Path(args.target), name=args.served_model_name, max_batch=args.max_batch,
                      adaptive=method.k == AUTO, options=options)
    print(f"verispec: serving {args.served_model_name or target.name} ({method.label}) at "
          f"http://{args.host}:{args.port}/v1", flush=True)
    run_server(app, args.host, args.port, args.shutdown_grace)


def _bench_serve(args: argparse.Namespace) -> None:
    from verispec.bench.report import machine
    from verispec.bench.serve import Workload, format_table, measure, measure_local, verdict, write_report
    from verispec.bench.suite import SUITE, read_suite

    levels = tuple(_whole_numbers(args.concurrency, "--concurrency"))
    items = read_suite(Path(args.suite) if args.suite else SUITE)
    if not all(isinstance(item.get("prompt"), str) for item in items):
        raise InvalidArgumentError("bench-serve sends the suite's prompts: each line needs a prompt (a Spec-Bench "
                                   "question file is for `verispec bench --suite`)")
    work = Workload([item["prompt"] for item in items], levels, args.requests, args.max_tokens)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="verispec-bench-serve-"))
    if args.url:
        if args.target or args.draft:
            raise InvalidArgumentError("--url measures running servers; --target and --draft would be ignored")
        servers = [url.split("=", 1) if "=" in url.split("://")[0] else (url, url) for url in args.url]
        results = {label: measure(url, work) for label, url in servers}
        setup = {"servers": ", ".join(f"{label} at {url}" for label, url in servers)}
    else:
        whole_number(args.max_batch, "--max-batch", 1)
        threads = args.threads or 1  # as `bench`: one thread unless told, so runs compare
        set_threads(threads)
        method = _checked_method(args)
        target, drafter = _load_models(args, method)
        if drafter is None:
            raise InvalidArgumentError("bench-serve compares speculation with plain decoding; give it a method "
                                       "that drafts (--draft, or --method)")
        results = measure_local(target, drafter, method.label, work, max_batch=args.max_batch, threads=threads,
                                adaptive=method.k == AUTO)
        setup = {"target": str(args.target), "method": method.label, "dtype": args.dtype, "max batch": args.max_batch}
        setup |= machine()
    report = write_report(out, results, work, setup)
    print(format_table(results))
    print("\n".join(verdict(results)) if len(results) > 1 else "")
    print(f"report: {report}")


def _search_layerskip(args: argparse.Namespace) -> None:
    from verispec.bench.layer_skip_search import search_skip, write_plan

    set_threads(args.threads)
    target = load_model(args.target)
    texts = [Path(file).read_text(encoding="utf-8", errors="replace") for file in args.text] or None
    plan = search_skip(target, texts, k=args.k, prompts=args.prompts, prompt_len=args.prompt_len,
                       new_tokens=args.new_tokens)
    print(f"data: {plan.data}; k={plan.k}, r(k+1)={plan.r:.2f}, share outside the blocks f={plan.fixed_share:.2f}")
    for step in plan.steps:
        print(f"skip layer {step['layer']}: acceptance {step['agreement']:.3f}, tau {step['tau']:.2f}, "
              f"predicted speedup {step['predicted_speedup']:.2f}x")
    layers = target.config.num_hidden_layers
    print(f"chosen: skip {plan.skip} of {layers} layers; acceptance {plan.agreement:.3f}, c {plan.c:.2f}, "
          f"predicted speedup {plan.predicted_speedup:.2f}x")
    if plan.predicted_speedup <= 1:
        print("(predicted speedup at most 1: layer skip will not pay on this model)")
    print(f"wrote {write_plan(plan, args.target)}")


def _init_random(args: argparse.Namespace) -> None:
    if not 1 <= args.draft_layers <= args.layers:
        raise InvalidArgumentError("--draft-layers must be between 1 and --layers")
    config = tiny_config(num_hidden_layers=args.layers, hidden_size=args.hidden_size,
                         intermediate_size=4 * args.hidden_size, num_attention_heads=4, num_key_value_heads=2)
    target, draft = random_pair(args.folder, config, args.draft_layers, args.seed)
    print(f"wrote {target} and {draft} (random weights: the text is noise, the mechanics are real)")


def _bench(args: argparse.Namespace) -> None:
    from verispec.bench.harness import BenchOptions, run_bench, run_quick  # loads matplotlib and tqdm on demand
    from verispec.bench.llamacpp import find_llama_cpp
    from verispec.bench.report import format_summary
    from verispec.bench.suite import SUITE, read_suite

    if args.repeats is not None and args.repeats < 1:
        raise InvalidArgumentError(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InvalidArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.target is None and not args.quick:  # the shipped default pair, as for generate
        args.target, default_draft = default_paths()
        args.draft = args.draft or default_draft
        shipped = {kind: MODELS / f"stdlib-{kind}" for kind in ("eagle", "medusa")}
        shipped = {kind: folder if (folder / "config.json").is_file() else None for kind, folder in shipped.items()}
        args.head, args.medusa_head = args.head or shipped["eagle"], args.medusa_head or shipped["medusa"]
    if args.target is not None and args.head is None and is_gguf(args.target):  # the head shipped for its model
        args.head = shipped_head_for(Path(args.target), "eagle")
    # Not the current folder, where a report would litter a checkout; a fresh folder, so runs never mix.
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="verispec-bench-"))
    if args.profile:
        from verispec.bench.profile_forward import run_profile

        with torch_threads(args.threads):
            command = " ".join(["verispec", *sys.argv[1:]])
            print(run_profile(Path(args.target), out, command, rounds=args.repeats or 15).read_text())
        return
    if args.quick:
        summary = run_quick(out, threads=args.threads)
    else:
        suite = read_suite(Path(args.suite) if args.suite else SUITE)
        only = [name.strip() for name in args.methods.split(",")] if args.methods else None
        options = BenchOptions(args.repeats or 3, not args.no_peers, threads=args.threads, dtype=args.dtype,
                               quantize=args.quantize,
                               exact=args.exact, only=only, head_dir=Path(args.head) if args.head else None,
                               medusa_dir=Path(args.medusa_head) if args.medusa_head else None,
                               unrelated=args.unrelated, llama_cpp=find_llama_cpp(args.llama_cpp),
                               max_new_tokens=args.max_new_tokens)
        summary = run_bench(Path(args.target), Path(args.draft) if args.draft else None, out, suite, options)
    print(format_summary(summary))
    print(f"report: {out / 'report.md'}")


def _train(args: argparse.Namespace) -> None:
    from verispec.train.card import write_cards  # training code loads on demand
    from verispec.train.corpus import MANIFEST, build_manifest, write_manifest
    from verispec.train.draft import train_draft
    from verispec.train.loop import TrainConfig
    from verispec.train.target import train_target

    if args.what == "manifest":
        write_manifest(build_manifest())
        print(f"wrote {MANIFEST}")
        return
    if args.threads is not None:
        set_threads(args.threads)
    runs, cfg = Path(args.runs), TrainConfig(hours=args.hours, batch_size=args.batch_size)
    if args.what == "card":
        models = [runs / "target" / "model", runs / "draft" / "model"]
        numbers = write_cards(*(load_model(m) for m in models), *models, runs / "target", runs / "draft")
        print(json.dumps(numbers, indent=2))
        return
    if args.what == "eagle-card" and _other_target(args.target):
        from verispec.bench.suite import read_suite
        from verispec.train.head_cards import write_eagle3_card

        if not args.questions:
            raise InvalidArgumentError("train eagle-card for this target measures on Spec-Bench questions: give "
                                       "--questions FILE (a question.jsonl)")
        target = load(args.target, "native", "cpu", "auto", exact=True)
        numbers = write_eagle3_card(target, _chat_template(args).render, runs / "eagle3" / "model", runs / "eagle3",
                                    read_suite(Path(args.questions)), args.questions)
        print(json.dumps(numbers, indent=2))
        return
    if args.what in ("eagle-card", "medusa-card"):
        from verispec.train.head_cards import write_eagle_card, write_medusa_card

        kind = args.what.removesuffix("-card")
        target_dir = Path(args.target) if args.target else default_paths()[0]
        write = {"eagle": write_eagle_card, "medusa": write_medusa_card}[kind]
        print(json.dumps(write(load_model(target_dir), runs / kind / "model", runs / kind), indent=2))
        return
    if args.what == "target":
        folder = train_target(runs / "target", cfg)
    elif args.what == "distill" or (args.what == "eagle" and _other_target(args.target)):
        from verispec.train.target_heads import distill_answers, train_target_head

        if args.what == "eagle":
            folder = train_target_head(runs, Path(args.target), cfg)
        else:
            shard, shards = _shard(args.shard)
            folder = distill_answers(runs, Path(_needs_target(args.target)), args.prompts, shard, shards)
    elif args.what in ("eagle", "medusa"):
        from verispec.train.eagle import train_eagle
        from verispec.train.medusa import train_medusa

        trainer = {"eagle": train_eagle, "medusa": train_medusa}[args.what]
        folder = trainer(runs / args.what, Path(args.target) if args.target else default_paths()[0], cfg)
    else:
        folder = train_draft(runs / "draft", runs / "target" / "model", cfg)
    print(f"exported {folder}")


def _other_target(target: str | None) -> bool:
    """Whether `train --target` names a target other than the shipped one (a real model, trained on its own answers)."""
    return target is not None and Path(target).resolve() != DEFAULT_TARGET.resolve()


def _needs_target(target: str | None) -> str:
    if target is None:
        raise InvalidArgumentError("train distill needs the target whose answers it records (--target FILE.gguf|DIR)")
    return target


def _shard(text: str) -> tuple[int, int]:
    """--shard I/N: 0 <= I < N."""
    try:
        shard, shards = (int(part) for part in text.split("/"))
    except ValueError:
        raise InvalidArgumentError(f"--shard takes I/N, e.g. 0/2, got {text!r}") from None
    if not 0 <= shard < shards:
        raise InvalidArgumentError(f"--shard {text}: I must be at least 0 and below N")
    return shard, shards


def _export(args: argparse.Namespace) -> None:
    from verispec.models.eagle_export import export_eagle

    head = Path(args.head) if args.head else MODELS / "stdlib-eagle"
    draft_vocab = None if args.draft_vocab is None else whole_number(args.draft_vocab, "--draft-vocab", 0)
    print(f"exported {export_eagle(head, args.out, args.engine, draft_vocab)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None and args.threads < 1:  # checked here for every command
            raise InvalidArgumentError(f"--threads must be >= 1, got {args.threads}")
        args.auto_dtype = getattr(args, "dtype", None) == "auto"
        if args.auto_dtype:  # the native runtime's choice; `_load_target` gives transformers float32
            set_threads(args.threads)  # first: the kernels run on one thread, so the choice depends on the count
            if getattr(args, "backend", None) == "transformers" or getattr(args, "quantize", None):
                args.dtype = "float32"
            else:
                args.dtype = auto_dtype(getattr(args, "device", "cpu"), getattr(args, "target", None))
        code = {"generate": _generate, "init-random": _init_random, "train": _train, "bench": _bench,
                "search-layerskip": _search_layerskip, "serve": _serve, "chat": _chat,
                "bench-serve": _bench_serve, "export": _export}[args.command](args)
    except (VerispecError, OSError) as err:
        if isinstance(err, BrokenPipeError):  # the reader went away (e.g. `| head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"verispec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before or after generate's streaming, which prints its own partial stats
        print(file=sys.stderr)  # so that the shell's prompt does not follow ^C on the same line
        return 130
    except Exception as err:  # a bug, not bad input: still one line; VERISPEC_DEBUG=1 shows the traceback
        if os.environ.get("VERISPEC_DEBUG"):
            raise
        print(f"verispec: internal error: {type(err).__name__}: {err} (VERISPEC_DEBUG=1 for details)", file=sys.stderr)
        return 1
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
