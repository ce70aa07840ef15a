"""The command line's grammar: every subcommand and option (verispec/cli/ runs them)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from verispec.checkpoints.blocks import FORMATS
from verispec.drafters.registry import FAMILIES, OPTIONS, families_taking
from verispec.engine.kv_budget import DEFAULT_CONTEXT, DEFAULT_MEMORY, byte_size
from verispec.errors import InvalidArgumentError
from verispec.models.auto import BACKENDS
from verispec.models.precision import DTYPES, KV_DTYPES
from verispec.serve.options import API_KEY_ENV, MAX_BODY_BYTES, STALL_SECONDS


class Parser(argparse.ArgumentParser):
    """argparse, with a bad command line reported as the other bad input is: one line (main prints it, exit 2), not
    the usage block."""

    def error(self, message: str) -> NoReturn:
        raise InvalidArgumentError(f"{message} (`{self.prog} --help` lists the options)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="verispec", description="Lossless speculative decoding.")  # its subcommands' class too
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="continue a prompt with speculative decoding")
    gen.add_argument("prompt", nargs="?", help="the text to continue; - reads it from stdin")
    gen.add_argument("--prompt-file", help="read the prompt from this UTF-8 file (verbatim, final newline included)")
    add_model_args(gen)
    add_decoding_args(gen)
    add_grammar_args(gen)
    gen.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message: put it (after --system) "
        "through the checkpoint's chat template and print the reply",
    )
    gen.add_argument("--compare", action="store_true", help="also decode autoregressively; print speedup and identity")
    add_runtime_args(gen)
    cht = sub.add_parser(
        "chat",
        help="a multi-turn conversation through the checkpoint's chat template, streamed; "
        "the KV cache is kept across turns",
    )
    add_model_args(cht)
    add_decoding_args(cht, None)
    add_runtime_args(cht)
    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, models, health, metrics) over the batched engine",
    )
    add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="most sequences decoded together (default 16); more requests wait for a free slot",
    )
    add_kv_args(srv)
    srv.add_argument("--served-model-name", help="the model name clients send (default: the target folder's name)")
    srv.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, seconds in-flight requests may still run before they are ended "
        "(default 30; a second Ctrl-C quits at once)",
    )
    srv.add_argument(
        "--api-key",
        help=f"require `Authorization: Bearer KEY` on every /v1 route (default: ${API_KEY_ENV} where set, else none)",
    )
    srv.add_argument(
        "--allowed-hosts",
        help="comma-separated Host header names to answer, * for any (default: "
        "localhost, 127.0.0.1 and ::1 when --host is loopback, else any)",
    )
    srv.add_argument("--no-docs", action="store_true", help="serve no /docs, /redoc or /openapi.json")
    srv.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"larger request bodies get a 413 (default {MAX_BODY_BYTES})",
    )
    srv.add_argument(
        "--health-stall",
        type=float,
        default=STALL_SECONDS,
        help=f"/health answers 503 once the engine has spent this many seconds in one step (default {STALL_SECONDS:g})",
    )
    add_runtime_args(srv)
    bsv = sub.add_parser(
        "bench-serve",
        help="throughput and latency of a server at 1, 4 and 16 concurrent "
        "streaming clients: plain decoding vs speculation",
    )
    bsv.add_argument(
        "--url",
        action="append",
        default=[],
        help="[LABEL=]URL of a running OpenAI-compatible server (verispec, vLLM, SGLang; repeatable, the "
        "first is the baseline); without it, plain decoding and --method are served here in turn",
    )
    add_model_args(bsv)
    bsv.add_argument("--concurrency", default="1,4,16", help="concurrent clients per level (default 1,4,16)")
    bsv.add_argument("--requests", type=int, default=32, help="streamed completions per level (default 32)")
    bsv.add_argument("--max-tokens", type=int, default=128, help="tokens per completion, EOS ignored (default 128)")
    bsv.add_argument("--suite", help="prompts (jsonl with a prompt field; default data/bench/suite.jsonl)")
    bsv.add_argument("--max-batch", type=int, default=16, help="the local servers' batch (default 16)")
    add_kv_args(bsv)
    bsv.add_argument("--out", help="folder for report.md and results.json (default: a new temporary folder)")
    add_runtime_args(bsv)
    rnd = sub.add_parser("init-random", help="write a random target/draft pair (byte tokenizer) to try the engine")
    rnd.add_argument("folder")
    rnd.add_argument("--layers", type=int, default=4)
    rnd.add_argument("--draft-layers", type=int, default=1)
    rnd.add_argument("--hidden-size", type=int, default=128)
    rnd.add_argument("--seed", type=int, default=0)
    lsk = sub.add_parser(
        "search-layerskip", help="choose the layers --method layerskip skips; writes TARGET/layerskip.json"
    )
    lsk.add_argument("--target", required=True, help="target checkpoint folder or GGUF file (native runtime)")
    lsk.add_argument("-k", "--k", type=int, default=4, help="tokens drafted per step to optimise for (default 4)")
    lsk.add_argument("--prompts", type=int, default=8, help="prompts cut from the validation text (default 8)")
    lsk.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    lsk.add_argument("--new-tokens", type=int, default=32, help="tokens each greedy run generates (default 32)")
    lsk.add_argument(
        "--text",
        action="append",
        default=[],
        help="a text file to measure on (repeatable); default: the corpus's validation split",
    )
    lsk.add_argument("--threads", type=int, default=1, help="threads for the search and its timings (default 1)")
    lsk.add_argument(
        "--out",
        help="write the plan to this .json file instead (needed for a GGUF target, which has no "
        "folder), for --skip FILE.json",
    )
    bench = sub.add_parser("bench", help="speed, acceptance and exactness of every method, with transformers as peers")
    bench.add_argument(
        "--target",
        help="target checkpoint, a folder or a GGUF file; default: the shipped "
        "models/stdlib-target, with models/stdlib-draft as the draft",
    )
    bench.add_argument(
        "--draft", help="draft checkpoint, a folder or a GGUF file (with --target and without it: no draft-model rows)"
    )
    bench.add_argument(
        "--head",
        help="EAGLE head folder, which adds the EAGLE rows (default: models/stdlib-eagle "
        "with the shipped target, where it exists)",
    )
    bench.add_argument(
        "--medusa-head",
        help="Medusa heads folder, which adds the Medusa rows (default: "
        "models/stdlib-medusa with the shipped target, where it exists)",
    )
    bench.add_argument(
        "--suite",
        default=None,
        help="prompts (jsonl with id, category, prompt, max_new_tokens), or "
        "Spec-Bench's question.jsonl (question_id, category, turns: each "
        "turn through the target's chat template); default "
        "data/bench/suite.jsonl",
    )
    bench.add_argument(
        "--max-new-tokens",
        type=int,
        help="every prompt's answer length; a Spec-Bench turn's: its "
        "plain greedy answer's, to EOS or at most this (default "
        "1024, Spec-Bench's)",
    )
    bench.add_argument(
        "--repeats", type=int, help="repeats of each run (default 3); with --profile, rounds of forwards (default 15)"
    )
    bench.add_argument(
        "--out",
        help="folder for report.md, results.json and plots (default: a new folder under "
        "the system's temporary folder; printed at the end)",
    )
    bench.add_argument("--no-peers", action="store_true", help="skip transformers' generate, assisted and lookup")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="tiny random models, six short prompts, 2 repeats (seconds); other options but --out "
        "and --threads do not apply",
    )
    bench.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads of every row, ours (verispec's kernels and torch) and llama.cpp's (-t N -tb N), "
        "fixed for the whole run (default 1)",
    )
    bench.add_argument(
        "--float64-prompts",
        type=int,
        default=8,
        metavar="N",
        help="the float64 check's prompts, the shortest (default 8; 0: not run, as for a model whose "
        "float64 copy would not fit in memory)",
    )
    bench.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", *sorted(DTYPES)],
        help="our models' and the peers' dtype (default float32; the float64 check is separate); "
        "auto: a GGUF target's own formats, blocks kept",
    )
    bench.add_argument(
        "--quantize",
        choices=sorted(FORMATS),
        help="keep the target's projections in this block format (its LM head in q8_0); llama.cpp gets the same blocks",
    )
    bench.add_argument(
        "--exact",
        action="store_true",
        help="our models in exact mode (batch-invariant forwards; the peers run as they are)",
    )
    bench.add_argument(
        "--formats",
        action="store_true",
        help="instead: the target's 1-token step and r(n), n = 1 .. 16, in every weight format (float32, "
        "bfloat16, q8_0, q4_0, q4_1, q5_0, q5_1; a GGUF's own), beside each one's weight-read time; "
        "writes formats.md (--target, --out and --repeats, rounds (default 7), apply; at one "
        "thread and at --threads N)",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="instead: profile the target's 1-token forward (float32 and bfloat16, ordinary and exact, "
        "plain and fast kernels) against its weight-read time; writes forward-profile.md "
        "(--target, --out, --threads and --repeats apply)",
    )
    bench.add_argument(
        "--startup",
        action="store_true",
        help="instead: time fresh processes from their start to one generated token, with their peak "
        "memory: `verispec generate --max-new-tokens 1`, and llama.cpp's llama-completion -n 1 on "
        "the same file with --llama-cpp; writes startup.md (--target, --out, --threads and "
        "--repeats, runs (default 5), apply)",
    )
    bench.add_argument(
        "--unrelated",
        action="store_true",
        help="also run the draft model at k=4 and k=auto on a never-agreeing pair: the target with a "
        "random draft of the draft's shape and tokenizer (--quick always does)",
    )
    bench.add_argument(
        "--per-category",
        type=int,
        help="only the first N prompts (Spec-Bench: questions) of each category of the suite",
    )
    bench.add_argument(
        "--methods",
        help="comma-separated rows to run, by their labels (default: all); must include "
        "autoregressive, the baseline; any other method as a label too, e.g. "
        '"suffix k=auto min_prob=0.3"',
    )
    bench.add_argument(
        "--llama-cpp",
        metavar="DIR",
        help="llama.cpp's binaries (llama-completion, "
        "llama-speculative-simple, llama-lookup), which add its rows as peers (default: "
        "$VERISPEC_LLAMA_CPP; neither: no llama.cpp rows); see docs/bench/llama-cpp.md",
    )
    trn = sub.add_parser("train", help="train the default models on the Python standard library (hours; never in CI)")
    trn.add_argument(
        "what",
        choices=("manifest", "target", "draft", "card", "eagle", "eagle-card", "medusa", "medusa-card", "distill"),
        help="the corpus manifest, the target, the draft (distilled from RUNS/target/model), the cards, "
        "an EAGLE head for --target (RUNS/eagle; for a target other than the shipped one an EAGLE-3 "
        "head, RUNS/eagle3, on the target's own answers (distill first), prose and code) or Medusa "
        "heads (RUNS/medusa), or their cards; distill: --target's answers to instruction prompts "
        "(RUNS/distill)",
    )
    trn.add_argument(
        "--runs", default="runs", help="RUNS/target, RUNS/draft and RUNS/eagle hold checkpoints, logs and exports"
    )
    trn.add_argument(
        "--target", help="eagle, medusa and their cards: the target the heads are for (default: the shipped target)"
    )
    trn.add_argument("--hours", type=float, default=2.0, help="training-time budget, counted across resumes")
    trn.add_argument("--batch-size", type=int, default=8)
    trn.add_argument("--threads", type=int, help="threads (default: torch's, one per core: training is compute-bound)")
    trn.add_argument(
        "--questions",
        metavar="FILE",
        help="eagle-card for a target other than the shipped one: the "
        "Spec-Bench question.jsonl its numbers are measured on",
    )
    trn.add_argument(
        "--per-category",
        type=int,
        default=4,
        help="eagle-card with --questions: the first N questions of each category",
    )
    trn.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="eagle-card with --questions: each turn's answer, to EOS or at most this",
    )
    trn.add_argument("--prompts", type=int, default=2400, help="distill: how many instruction prompts to answer")
    trn.add_argument(
        "--shard",
        default="0/1",
        help="distill: I/N answers every N-th prompt from the I-th (0-based), so that N processes share the work",
    )
    exp = sub.add_parser("export", help="a drafter's folder as a serving engine loads it (docs/scale-out.md)")
    exp.add_argument("what", choices=("eagle",), help="the drafter (the draft model's folder loads as it is)")
    exp.add_argument("out", help="the folder to write")
    exp.add_argument("--for", dest="engine", required=True, choices=("vllm", "sglang"), help="the engine")
    exp.add_argument("--head", help="the EAGLE head's folder (default: the shipped head)")
    exp.add_argument(
        "--draft-vocab",
        type=int,
        help="sglang: tokens in the token map (default: the head's "
        "verispec.draft_vocab; 0: no token map, the full vocabulary)",
    )
    return parser


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
        help="draft checkpoint, a folder or a GGUF file (--method draft); with --target and without it, plain decoding",
    )
    parser.add_argument(
        "--method",
        choices=list(FAMILIES),
        default="draft",
        help="; ".join(f"{name}: {family.summary}" for name, family in FAMILIES.items()),
    )
    parser.add_argument(
        "-k",
        help="tokens drafted per step, or auto: chosen per step from this generation's "
        "acceptance and timings, up to 8, and 0 (plain decoding) where drafting does not "
        "pay (default auto for draft, ngram, selfquant and suffix chains, suffix's cutting "
        "each proposal by its own estimates; 4 for eagle and trees but suffix's, 8 deep; "
        "layerskip: the k in layerskip.json; lookahead drafts N - 1, set by --ngram-size, "
        "or auto: on or off)",
    )
    parser.add_argument(
        "--head",
        help="eagle, medusa, suffix with --eagle-below: the head's folder (default: "
        "models/stdlib-eagle or models/stdlib-medusa for the shipped target)",
    )
    # The methods' options, as the registry declares them. Each defaults to None here, so that only what was given
    # reaches the method record (the defaults live in the drafters) and an option given to a method that does not
    # take it is refused.
    for name, option in OPTIONS.items():
        parser.add_argument(
            option.flag_for(name),
            dest=name,
            type=option.type,
            choices=option.choices,
            help=f"{', '.join(families_taking(name))}: {option.help}",
        )


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


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Where and how the models run."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *sorted(DTYPES)],
        help="auto (default): a GGUF file's own formats (its ggml blocks kept where "
        "verispec's kernels run); else bfloat16 where verispec's kernels run, else float32",
    )
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
