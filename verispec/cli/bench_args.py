"""The command line's grammar of the commands that measure a model: bench and search-layerskip (cli/bench.py runs
them)."""

from __future__ import annotations

import argparse

from verispec.checkpoints.blocks import FORMATS
from verispec.cli.common_args import add_chat_template_arg, add_dtype_arg


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    """`verispec search-layerskip` and `verispec bench`, with their options."""
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
    add_chat_template_arg(bench)  # (a Spec-Bench suite's turns)
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
    add_dtype_arg(bench, "our models' and the peers' dtype (the float64 check is separate)")
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
