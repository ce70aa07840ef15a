"""The method record and the models it runs on, from the command line's model and runtime options
(cli/common_args.py `add_model_args`, `add_runtime_args`): checked before anything loads, then loaded."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verispec.checkpoints.gguf_file import is_gguf
from verispec.checkpoints.shipped import default_paths
from verispec.drafters.base import Drafter, Needs
from verispec.drafters.registry import (
    AUTO,
    OPTIONS,
    Method,
    Resources,
    build_drafter,
    check_method,
    resolve_method,
)
from verispec.errors import InvalidArgumentError, UnsupportedArchitectureError
from verispec.models.auto import load
from verispec.models.native import own_kernels_run
from verispec.models.precision import DEFAULT_DTYPE
from verispec.models.protocol import CausalLM


def method_from(args: argparse.Namespace) -> Method:
    """The method record from the command line: only the options that were given, k only where given (the family's
    record has the defaults); without --method, `default_method`'s."""
    options = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    k = _k_arg(args.k)
    method = args.method or default_method(args)
    if method == "draft" and not args.draft and not options:  # a folder --target alone decodes plainly
        return Method("autoregressive", k)
    return Method(method, k, options)


def default_method(args: argparse.Namespace) -> str:
    """What runs without --method: the draft model with --draft (the shipped pair has one), `auto` on a GGUF target
    without one (its shipped head, else suffix decoding), else plain decoding (`method_from`)."""
    return AUTO if args.target is not None and not args.draft and is_gguf(args.target) else "draft"


def _k_arg(text: str | None) -> int | str | None:
    """-k: a whole number (checked by the registry, with the other options) or auto."""
    if text is None or text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"-k takes a whole number of tokens or auto, got {text!r}") from None


def checked_method(args: argparse.Namespace) -> Method:
    """The method record of `add_model_args`' options as it runs (`resolve_method`: auto's choice, which
    `load_models` says on stderr, and the family's default k), checked before any model loads; fills in the shipped
    pair where no --target was given."""
    given_draft = args.draft
    if args.target is None:  # the shipped default pair
        args.target, default_draft = default_paths()
        args.draft = args.draft or default_draft
    method = method_from(args)
    given = Resources(
        target_dir=Path(args.target),
        head_dir=Path(args.head) if args.head else None,
        draft_dir=Path(args.draft) if args.draft else None,
    )
    method = resolve_method(method, given)  # auto's choice and the family's defaults, before loading anything
    needs = check_method(method)
    if given_draft and not drafts_with_model(method):
        raise InvalidArgumentError(
            f"--draft is the draft model of --method draft (or suffix with --draft-below); "
            f"--method {args.method or method.family} would ignore it"
        )
    if args.head and method.family not in ("eagle", "medusa") and "eagle_below" not in method.options:
        raise InvalidArgumentError(
            f"--head is the head of --method eagle or medusa (or suffix with --eagle-below); "
            f"--method {args.method or method.family} would ignore it"
        )
    if args.backend == "transformers" and needs != Needs():
        raise InvalidArgumentError(
            f"method {method.label} needs the native runtime (tree masks, hidden states, "
            f"layer subsets or a twin of its weights); --backend transformers offers none "
            f"of them"
        )
    return method


def drafts_with_model(method: Method) -> bool:
    """Whether the method drafts with the draft model (--draft): the draft family, or suffix where its match is
    short (draft_below)."""
    return method.family == "draft" or (method.family == "suffix" and method.options.get("draft_below") is not None)


def load_target(args: argparse.Namespace) -> CausalLM:
    """The target, in exact mode if --exact. Without --exact or --no-exact, `generate`, `serve` and `bench-serve` take
    exact mode where the native runtime runs the target on verispec's kernels (there it costs next to nothing, and
    the server's batched forwards give each request the bits it gets alone). --dtype left at auto is `load`'s auto:
    a target that only transformers runs takes float32 (its bfloat16 has none of those kernels)."""
    dtype = DEFAULT_DTYPE if args.auto_dtype else args.dtype  # (args.dtype: what auto chose for the native runtime)
    options = {"quantize": args.quantize, "kv_dtype": args.kv_dtype}  # the native runtime's
    auto_exact = args.exact is None and args.command in ("generate", "serve", "bench-serve")
    if args.backend == "transformers" or not auto_exact:
        return load(args.target, args.backend, args.device, dtype, exact=bool(args.exact), **options)
    try:  # exact mode where it is free; without it where only transformers runs the target
        exact = own_kernels_run(args.dtype, args.device)
        return load(args.target, "native", args.device, dtype, exact=exact, **options)
    except UnsupportedArchitectureError:
        if args.backend == "native" or args.quantize or args.kv_dtype != "auto":
            raise
        # auto's own fallback (it says what both runtimes made of the folder), at no exact mode
        return load(args.target, "auto", args.device, dtype)


def load_models(args: argparse.Namespace, method: Method) -> tuple[CausalLM, Drafter | None]:
    """The target and the method's drafter (None: plain decoding), from `add_model_args`' and `add_runtime_args`'
    options."""
    target = load_target(args)
    draft = None
    if drafts_with_model(method) and args.draft:  # never exact: the target decides every token
        draft = load(args.draft, args.backend, args.device, args.dtype)
    head = Path(args.head) if args.head else None
    draft_dir = Path(args.draft) if draft is not None else None
    drafter = build_drafter(method, Resources(draft, Path(args.target), target, head, draft_dir))
    if method.reason is not None:  # once it runs: a refusal before this is the one line printed
        print(f"verispec: method auto chose {method.label}: {method.reason}", file=sys.stderr, flush=True)
    return target, drafter
