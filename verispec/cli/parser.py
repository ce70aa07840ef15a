"""The command line's grammar: every subcommand and its options (verispec/cli/ runs them); the options several
commands share are in cli/common_args.py, bench's and search-layerskip's in cli/bench_args.py."""

from __future__ import annotations

import argparse
from typing import NoReturn

from verispec.cli.bench_args import add_bench_commands
from verispec.cli.common_args import (
    add_chat_template_arg,
    add_decoding_args,
    add_grammar_args,
    add_kv_args,
    add_model_args,
    add_runtime_args,
)
from verispec.errors import InvalidArgumentError
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
    add_chat_template_arg(gen)
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
    add_chat_template_arg(cht)
    add_decoding_args(cht, None)
    add_runtime_args(cht)
    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, models, health, metrics) over the batched engine",
    )
    add_model_args(srv)
    add_chat_template_arg(srv)
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
    add_bench_commands(sub)
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
