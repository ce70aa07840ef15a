"""The commands that load a target and decode with it: generate (one prompt, streamed), chat (a conversation on the
terminal) and serve (the HTTP server over the batched engine)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer

from verispec.chat import Chat
from verispec.checkpoints.chat_template import (
    WHERE_TEMPLATES_LIVE,
    ChatTemplate,
    has_chat_template,
    load_chat_template,
)
from verispec.cli.inputs import check_options, decoding_options, given_template, grammar_from, read_prompt, unescape
from verispec.cli.loading import checked_method, load_models
from verispec.cli.output import GREEN, RESET, print_stream, stats_lines, use_color
from verispec.drafters.registry import AUTO
from verispec.errors import InvalidArgumentError, VerispecError
from verispec.generate import generate, stream
from verispec.sampling import SamplingParams
from verispec.threads import set_threads


def generate_command(args: argparse.Namespace) -> int:
    """`verispec generate`: the prompt continued and streamed, then the stats (and, with --compare, plain decoding's
    time and whether its tokens are the same)."""
    args.prompt = read_prompt(args)
    args.stop = [unescape(stop, "--stop") for stop in args.stop]
    check_options(args)
    set_threads(args.threads)
    grammar = grammar_from(args)
    given = given_template(args)  # read before seconds of loading
    target, drafter = load_models(args, checked_method(args))
    options = decoding_options(args) | {"grammar": grammar}  # --compare decodes under the same grammar
    prompt = args.prompt  # --chat: the message as the template's one user turn, after the system message if any
    if args.chat:
        turn = [
            *([{"role": "system", "content": args.system}] if args.system else []),
            {"role": "user", "content": args.prompt},
        ]
        prompt = target.tokenizer.encode(
            chat_template(args, target.tokenizer, given).render(turn), add_special_tokens=False
        ).ids
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
        print(
            f"autoregressive: {plain.stats.new_tokens} tokens in {plain.stats.total_time:.3f} s "
            f"({plain.stats.tokens_per_second:.1f} tok/s); speedup {plain.stats.total_time / spec_time:.2f}x"
        )
        note = "" if SamplingParams(args.temperature).greedy else " (sampling: same distribution, not the same draws)"
        print(f"identical to autoregressive: {'yes' if plain.tokens == result.tokens else 'no'}{note}")
    return 0


def chat_template(
    args: argparse.Namespace, tokenizer: Tokenizer | None = None, given: str | None = None
) -> ChatTemplate:
    """The chat template `given` (`given_template`), else the target checkpoint's own (held by the loaded target's
    `tokenizer`, for a GGUF file); a target without one, given none, refuses chat rather than guess a format."""
    template = load_chat_template(Path(args.target), tokenizer, given)
    if template is None:
        raise _no_template(args)
    return template


def _no_template(args: argparse.Namespace) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{args.target} has no chat template ({WHERE_TEMPLATES_LIVE}): chat needs the model's own, or one given with "
        "--chat-template FILE; or give `verispec generate` a plain prompt"
    )


def chat_command(args: argparse.Namespace) -> int:
    """`verispec chat`: a multi-turn conversation on the terminal: one line a message, /reset starts over, Ctrl-D
    quits; Ctrl-C ends the reply being written."""
    args.stop = [unescape(stop, "--stop") for stop in args.stop]
    check_options(args)
    set_threads(args.threads)
    method = checked_method(args)  # (fills in the shipped pair)
    given = given_template(args)  # before seconds of loading, as the target's own is looked for
    if given is None and not has_chat_template(Path(args.target)):
        raise _no_template(args)
    target, drafter = load_models(args, method)
    template = chat_template(args, target.tokenizer, given)
    chat, color = (
        Chat(target, template.render, drafter, system=args.system, **decoding_options(args)),
        use_color(args.color),
    )
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
        print(f"\n{steps.stats.line()}", flush=True)


def serve_command(args: argparse.Namespace) -> None:
    """`verispec serve`: the OpenAI-compatible server, until SIGINT or SIGTERM."""
    from verispec.serve.app import serving_app  # FastAPI and uvicorn load on demand
    from verispec.serve.options import ServeOptions, allowed_hosts, api_key
    from verispec.serve.server import check_server_options, run_server

    check_server_options(args.port, args.shutdown_grace, args.max_batch)
    options = ServeOptions(
        api_key(args.api_key),
        allowed_hosts(args.host, args.allowed_hosts),
        not args.no_docs,
        args.max_body_bytes,
        args.health_stall,
    )
    set_threads(args.threads)
    method = checked_method(args)
    given = given_template(args)
    target, drafter = load_models(args, method)
    app = serving_app(
        target,
        drafter,
        Path(args.target),
        chat_template=given,
        name=args.served_model_name,
        max_batch=args.max_batch,
        adaptive=method.k == AUTO,
        options=options,
        context=args.max_model_len,
        kv_memory=args.kv_cache_memory,
    )
    print(
        f"verispec: serving {args.served_model_name or target.name} ({method.label}) at "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    run_server(app, args.host, args.port, args.shutdown_grace)
