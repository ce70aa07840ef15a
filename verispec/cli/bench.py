"""The commands that measure: bench (every method against plain decoding and the peers), bench-serve (servers under
concurrent clients) and search-layerskip (the layers layer skip leaves out, chosen by measuring)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from verispec.argument_checks import whole_number
from verispec.checkpoints.gguf_file import is_gguf
from verispec.checkpoints.shipped import MODELS, default_paths, shipped_head_for
from verispec.cli.inputs import given_template, whole_numbers
from verispec.cli.loading import checked_method, load_models
from verispec.drafters.registry import AUTO
from verispec.errors import InvalidArgumentError
from verispec.models.native import load_model
from verispec.stats import peak_resident_bytes
from verispec.threads import set_threads, torch_threads


def bench_command(args: argparse.Namespace) -> None:
    """`verispec bench`: the report of every method (or --quick's tiny run, --formats' steps by weight format,
    --profile's forward profile, or --startup's time to a first token)."""
    from verispec.bench.harness import BenchOptions, run_bench, run_quick  # loads matplotlib and tqdm on demand
    from verispec.bench.llamacpp import find_llama_cpp
    from verispec.bench.report import format_summary
    from verispec.bench.suite import SUITE, read_suite

    if args.repeats is not None and args.repeats < 1:
        raise InvalidArgumentError(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InvalidArgumentError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.float64_prompts < 0:
        raise InvalidArgumentError(f"--float64-prompts must be >= 0, got {args.float64_prompts}")
    modes = [f"--{mode}" for mode in ("quick", "formats", "startup", "profile") if getattr(args, mode)]
    if args.chat_template is not None and modes:
        raise InvalidArgumentError(f"--chat-template renders a Spec-Bench suite's turns; {modes[0]} renders none")
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
    if args.formats:
        from verispec.bench.formats import run_formats

        command = " ".join(["verispec", *sys.argv[1:]])
        print(run_formats(Path(args.target), out, command, rounds=args.repeats or 7, threads=args.threads).read_text())
        return
    if args.startup:
        from verispec.bench.startup import run_startup

        command = " ".join(["verispec", *sys.argv[1:]])
        print(
            run_startup(
                Path(args.target),
                out,
                command,
                threads=args.threads,
                repeats=args.repeats or 5,
                llama_cpp=find_llama_cpp(args.llama_cpp),
            ).read_text()
        )
        return
    if args.profile:
        from verispec.bench.profile_forward import run_profile

        with torch_threads(args.threads):
            command = " ".join(["verispec", *sys.argv[1:]])
            print(run_profile(Path(args.target), out, command, rounds=args.repeats or 15).read_text())
        return
    if args.quick:
        summary = run_quick(out, threads=args.threads)
    else:
        suite = read_suite(Path(args.suite) if args.suite else SUITE, args.per_category)
        only = [name.strip() for name in args.methods.split(",")] if args.methods else None
        options = BenchOptions(
            args.repeats or 3,
            not args.no_peers,
            threads=args.threads,
            dtype=args.dtype,
            chat_template=given_template(args),
            quantize=args.quantize,
            exact=args.exact,
            only=only,
            head_dir=Path(args.head) if args.head else None,
            medusa_dir=Path(args.medusa_head) if args.medusa_head else None,
            unrelated=args.unrelated,
            llama_cpp=find_llama_cpp(args.llama_cpp),
            max_new_tokens=args.max_new_tokens,
            float64_prompts=args.float64_prompts,
        )
        summary = run_bench(Path(args.target), Path(args.draft) if args.draft else None, out, suite, options)
    print(format_summary(summary))
    print(f"report: {out / 'report.md'}")


def bench_serve_command(args: argparse.Namespace) -> None:
    """`verispec bench-serve`: running servers (--url), or plain decoding and the method served here in turn, under
    each level of concurrent streaming clients."""
    from verispec.bench.report import machine
    from verispec.bench.serve import Workload, format_table, measure, measure_local, verdict, write_report
    from verispec.bench.suite import SUITE, read_suite

    levels = tuple(whole_numbers(args.concurrency, "--concurrency"))
    items = read_suite(Path(args.suite) if args.suite else SUITE)
    if not all(isinstance(item.get("prompt"), str) for item in items):
        raise InvalidArgumentError(
            "bench-serve sends the suite's prompts: each line needs a prompt (a Spec-Bench "
            "question file is for `verispec bench --suite`)"
        )
    work = Workload([item["prompt"] for item in items], levels, args.requests, args.max_tokens)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="verispec-bench-serve-"))
    if args.url:
        if args.target or args.draft:
            raise InvalidArgumentError("--url measures running servers; --target and --draft would be ignored")
        servers = [url.split("=", 1) if "=" in url.split("://")[0] else (url, url) for url in args.url]
        reference: dict[str, str] = {}  # each prompt's answer alone: the first server's at its first level
        results = {label: measure(url, work, reference) for label, url in servers}
        setup = {"servers": ", ".join(f"{label} at {url}" for label, url in servers)}
    else:
        whole_number(args.max_batch, "--max-batch", 1)
        threads = set_threads(args.threads)  # as `serve`: the cores, unless told (the help says so)
        method = checked_method(args)
        target, drafter = load_models(args, method)
        if drafter is None:
            raise InvalidArgumentError(
                "bench-serve compares speculation with plain decoding; give it a method "
                "that drafts (--draft, or --method)"
            )
        results = measure_local(
            target,
            drafter,
            method.label,
            work,
            max_batch=args.max_batch,
            threads=threads,
            adaptive=method.k == AUTO,
            context=args.max_model_len,
            kv_memory=args.kv_cache_memory,
        )
        setup = {
            "target": str(args.target),
            "method": method.label,
            "dtype": args.dtype,
            "max batch": args.max_batch,
            "exact": getattr(target, "exact", False),
            "peak resident memory": f"{peak_resident_bytes() / 2**30:.2f} GiB",
        }
        setup |= machine()
    report = write_report(out, results, work, setup)
    print(format_table(results))
    print("\n".join(verdict(results)) if len(results) > 1 else "")
    print(f"report: {report}")


def search_layerskip_command(args: argparse.Namespace) -> None:
    """`verispec search-layerskip`: the layers to skip, chosen greedily by predicted speedup, written to
    TARGET/layerskip.json."""
    from verispec.bench.layer_skip_search import search_skip, write_plan

    if args.out is not None and not args.out.endswith(".json"):
        raise InvalidArgumentError(f"--out names the plan's .json file; got {args.out}")
    if args.out is None and is_gguf(args.target):
        raise InvalidArgumentError(
            "a GGUF target has no folder to write layerskip.json into: give --out PLAN.json (and then --skip PLAN.json)"
        )
    set_threads(args.threads)
    target = load_model(args.target)
    texts = [Path(file).read_text(encoding="utf-8", errors="replace") for file in args.text] or None
    plan = search_skip(
        target, texts, k=args.k, prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens
    )
    print(f"data: {plan.data}; k={plan.k}, r(k+1)={plan.r:.2f}, share outside the blocks f={plan.fixed_share:.2f}")
    for step in plan.steps:
        print(
            f"skip layer {step['layer']}: acceptance {step['agreement']:.3f}, tau {step['tau']:.2f}, "
            f"predicted speedup {step['predicted_speedup']:.2f}x"
        )
    layers = target.config.num_hidden_layers
    print(
        f"chosen: skip {plan.skip} of {layers} layers; acceptance {plan.agreement:.3f}, c {plan.c:.2f}, "
        f"predicted speedup {plan.predicted_speedup:.2f}x"
    )
    if plan.predicted_speedup <= 1:
        print("(predicted speedup at most 1: layer skip will not pay on this model)")
    print(f"wrote {write_plan(plan, args.out or args.target)}")
