"""What the command line prints while it decodes: the text as it streams (accepted draft tokens in green), and the
numbers after it."""

from __future__ import annotations

import os
import sys

from verispec.generate import Stream
from verispec.stats import GenerationStats

GREEN, RESET = "\x1b[32m", "\x1b[0m"


def use_color(choice: str) -> bool:
    """--color: always, never, or auto (a terminal, and no NO_COLOR in the environment)."""
    return choice == "always" or (choice == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ)


def print_stream(steps: Stream, color: bool, before: str = "") -> None:
    """Print each piece as it is accepted; `before` is printed once the first one is ready (the prefill and the
    first step run before anything shows)."""
    printed = False
    for piece in steps:
        if not printed:
            print(before, end="", flush=True)
            printed = True
        print(f"{GREEN}{piece.text}{RESET}" if color and piece.drafted else piece.text, end="", flush=True)
    if not printed:
        print(before, end="", flush=True)


def stats_lines(s: GenerationStats, stop_reason: str) -> list[str]:
    lines = [
        f"{s.new_tokens} tokens in {s.total_time:.3f} s ({s.tokens_per_second:.1f} tok/s), stop: {stop_reason}",
        f"target calls {s.target_calls}, tau {s.tau:.2f} tokens/call",
    ]
    if s.drafter_calls:
        by_pos = " ".join(f"{rate:.2f}" for rate in s.acceptance_by_position)
        lines += [
            f"drafted {s.proposed}, accepted {s.accepted} ({s.acceptance_rate:.1%}); by position: {by_pos}",
            f"time: prefill {s.prefill_time:.3f} s, draft {s.draft_time:.3f} s, verify {s.verify_time:.3f} s, "
            f"other {s.other_time:.3f} s",
        ]
        lines.insert(
            3, "steps by tokens drafted: " + ", ".join(f"{d}: {n}" for d, n in enumerate(s.steps_by_depth) if n)
        )
    return lines
