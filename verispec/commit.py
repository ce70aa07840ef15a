"""Committing one step's verdict: the bookkeeping that plain, speculative and batched decoding share."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.detokenize import TextTracker
from verispec.stats import GenerationStats
from verispec.tree import through_eos


@dataclass(frozen=True)
class Committed:
    tokens: list[int]  # what the step commits
    drafted: list[bool]  # per token: an accepted proposal (True) or the target's own token (False)
    stop_reason: str | None  # "eos" or "stop_string" when the step ends the generation


def commit_step(
    new: list[int], drafted: list[bool], proposed: int, eos: frozenset[int], text: TextTracker, stats: GenerationStats
) -> Committed:
    """The verdict's tokens (`new`, the accepted proposal and the target's own token; `proposed`: the proposal's
    depth), cut after an end-of-sequence token and at a stop string, added to the text and counted in the stats."""
    reason = None
    cut = through_eos(new, eos)  # nothing after an end-of-sequence token is kept
    if new[cut - 1] in eos:
        new, drafted, reason = new[:cut], drafted[:cut], "eos"
    new = new[: text.add(new, drafted)]
    if text.stopped:
        reason = "stop_string"
    drafted = drafted[: len(new)]
    stats.record_step(proposed, sum(drafted))  # a draft cut by a stop is not accepted
    stats.new_tokens += len(new)
    return Committed(new, drafted, reason)
