"""The commands that write model folders: train (the shipped models, their heads and cards), init-random (a random
pair to try the engine on) and export (a drafter's folder as a serving engine loads it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verispec.argument_checks import whole_number
from verispec.checkpoints.random_init import random_pair, tiny_config
from verispec.checkpoints.shipped import DEFAULT_TARGET, MODELS, default_paths
from verispec.errors import InvalidArgumentError
from verispec.models.native import load_model
from verispec.threads import set_threads


def train_command(args: argparse.Namespace) -> None:
    """`verispec train WHAT`: the corpus manifest, a model or head trained under RUNS, or their cards."""
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
        from verispec.cli.decode import chat_template
        from verispec.models.auto import load
        from verispec.train.head_cards import write_eagle3_card

        if not args.questions:
            raise InvalidArgumentError(
                "train eagle-card for this target measures on Spec-Bench questions: give "
                "--questions FILE (a question.jsonl)"
            )
        per_category = whole_number(args.per_category, "--per-category", 1)  # before the target loads
        max_new_tokens = whole_number(args.max_new_tokens, "--max-new-tokens", 1)
        target = load(args.target, "native", "cpu", "auto", exact=True)
        numbers = write_eagle3_card(
            target,
            chat_template(args, target.tokenizer).render,
            runs / "eagle3" / "model",
            runs / "eagle3",
            read_suite(Path(args.questions)),
            args.questions,
            per_category,
            max_new_tokens,
        )
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


def init_random_command(args: argparse.Namespace) -> None:
    """`verispec init-random FOLDER`: a target and a draft with random weights and a byte tokenizer."""
    if not 1 <= args.draft_layers <= args.layers:
        raise InvalidArgumentError("--draft-layers must be between 1 and --layers")
    config = tiny_config(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    target, draft = random_pair(args.folder, config, args.draft_layers, args.seed)
    print(f"wrote {target} and {draft} (random weights: the text is noise, the mechanics are real)")


def export_command(args: argparse.Namespace) -> None:
    """`verispec export eagle OUT --for ENGINE`: the EAGLE head as vLLM or SGLang loads it."""
    from verispec.heads.eagle_export import export_eagle

    head = Path(args.head) if args.head else MODELS / "stdlib-eagle"
    draft_vocab = None if args.draft_vocab is None else whole_number(args.draft_vocab, "--draft-vocab", 0)
    print(f"exported {export_eagle(head, args.out, args.engine, draft_vocab)}")
