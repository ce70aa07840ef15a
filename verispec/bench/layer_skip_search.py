"""Which layers `LayerSkip` leaves out: a greedy search on validation text for the best predicted speedup.

The model of a step (as in the benchmark): speedup = tau / (k c + r), with
- tau: the tokens per target call of real greedy speculative runs with the candidate skip set, continuing
  prompts cut from validation text (a teacher-forced agreement would miss that a draft reads the full model's
  cache for the committed prefix: on a random 4-layer model it gave 0.57 where the runs accepted 0.65);
- c: a skipping step's cost relative to a full step, f + (1 - f) kept / layers, where f is the share of a
  one-token forward outside the blocks (embedding, final norm, head, overhead), measured once from the timed
  forwards of the full model and of its first block alone;
- r: the cost of verifying k + 1 tokens relative to one token, measured with `forward_seconds`.
The search starts with no layer skipped, adds the layer whose removal gives the highest predicted speedup, and
stops when no addition improves it (the first layer is always added, so the plan is usable; the saved predicted
speedup tells whether it pays). Runs are greedy and ties go to the lowest layer index, so with c and r given
the same inputs give the same plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from verispec.drafters.layer_skip import PLAN_FILE, LayerSkip
from verispec.errors import InvalidArgumentError
from verispec.generate import generate
from verispec.models.native import NativeModel
from verispec.models.timing import forward_seconds

METHOD = (
    "greedy: add the layer that most raises tau / (k c + r), stop when none does; tau and acceptance from "
    "greedy speculative runs; c = f + (1 - f) kept / layers with f measured; r = measured time of k + 1 "
    "tokens / 1 token"
)


@dataclass(frozen=True)
class SkipPlan:
    """The search's result, as written to layerskip.json."""

    skip: list[int]
    k: int
    agreement: float  # the share of drafted tokens the target accepted, with this skip set
    tau: float  # tokens per target call
    predicted_speedup: float
    c: float  # a skipping step / a full step
    r: float  # verifying k + 1 tokens / one token
    fixed_share: float  # f: the share of a one-token forward outside the blocks
    method: str
    data: str
    steps: list[dict] = field(default_factory=list)  # per greedy step: layer added, agreement, tau, speedup


def validation_texts() -> tuple[list[str], str]:
    """The corpus's validation split (standard-library files no model trained on), and a description of it."""
    from verispec.train.corpus import load_split  # the corpus module is only needed here

    texts, skipped = load_split("validation")
    if not texts:
        raise InvalidArgumentError(f"no validation text: {skipped} files of the split are missing or changed here")
    return texts, f"stdlib validation split ({len(texts)} files)"


def text_prompts(target: NativeModel, texts: Sequence[str], count: int, length: int) -> list[list[int]]:
    """`count` evenly spaced windows of `length` tokens of the texts, each text encoded as a prompt is."""
    ids = [i for enc in target.tokenizer.encode_batch(list(texts)) for i in enc.ids]
    length = min(length, len(ids), target.context_length - 1)
    if count < 1 or length < 1:
        raise InvalidArgumentError(f"need at least one prompt of one token; got {count} of {length} tokens")
    return [ids[s : s + length] for s in np.linspace(0, len(ids) - length, count).astype(int)]


def measure(
    target: NativeModel, prompts: Sequence[Sequence[int]], skip: Sequence[int], k: int, new_tokens: int
) -> tuple[float, float]:
    """(acceptance, tau) of greedy speculative runs with `LayerSkip(skip, k)` over the prompts."""
    drafter, proposed, accepted, tokens, calls = LayerSkip(skip, k), 0, 0, 0, 0
    for prompt in prompts:
        s = generate(target, list(prompt), drafter, max_new_tokens=new_tokens, ignore_eos=True).stats
        proposed, accepted = proposed + s.proposed, accepted + s.accepted
        tokens, calls = tokens + s.new_tokens, calls + s.target_calls
    return accepted / max(1, proposed), tokens / calls


def measured_costs(target: NativeModel, k: int) -> tuple[float, float]:
    """(f, r): the share of a one-token forward outside the blocks, and r(k + 1), from timed forwards."""
    layers, repeats = target.config.num_hidden_layers, 15
    full = forward_seconds(target, 1, repeats=repeats)
    first = forward_seconds(target, 1, repeats=repeats, layers=[0])
    block = max(0.0, full - first) / (layers - 1)
    fixed = min(1.0, max(0.0, (full - layers * block) / full))
    # More tokens never cost less: a ratio below one is timing noise on a busy machine.
    return fixed, max(1.0, forward_seconds(target, k + 1, repeats=repeats) / full)


def search_skip(
    target: NativeModel,
    data: Sequence[str] | torch.Tensor | None = None,
    k: int = 4,
    *,
    prompts: int = 8,
    prompt_len: int = 64,
    new_tokens: int = 32,
    r: float | None = None,
    fixed_share: float | None = None,
) -> SkipPlan:
    """The skip set with the best predicted speedup at k drafts per step, found greedily (see the module doc).

    `data`: texts to cut `prompts` prompts of `prompt_len` tokens from, or the prompts' token ids (N, T); by
    default the corpus's validation split. Each run continues a prompt by `new_tokens` tokens. `r` and
    `fixed_share` are measured unless given (giving both makes the search independent of timing).
    """
    if not target.capabilities.layer_subsets:
        raise InvalidArgumentError(
            "the layer-skip search runs the target with layers left out, which only the native runtime can do"
        )
    if k < 1 or new_tokens < 1:
        raise InvalidArgumentError(f"k and new_tokens must be >= 1, got {k} and {new_tokens}")
    layers = target.num_layers
    if layers < 2:
        raise InvalidArgumentError(f"{target.name} has one layer: there is none to skip")
    if isinstance(data, torch.Tensor):
        ids, described = data.tolist(), f"given token ids ({data.shape[0]} x {data.shape[1]})"
    else:
        texts, described = validation_texts() if data is None else (list(data), f"{len(data)} given texts")
        ids = text_prompts(target, texts, prompts, prompt_len)
        described += f": {len(ids)} prompts of {len(ids[0])} tokens"
    described += f", {new_tokens} new tokens each"
    if fixed_share is None or r is None:
        measured_f, measured_r = measured_costs(target, k)
        fixed_share = measured_f if fixed_share is None else fixed_share
        r = measured_r if r is None else r

    def score(skip: list[int]) -> tuple[float, float, float]:
        acceptance, tau = measure(target, ids, skip, k, new_tokens)
        c = fixed_share + (1 - fixed_share) * (layers - len(skip)) / layers
        return tau / (k * c + r), acceptance, tau

    skip: list[int] = []
    best: tuple[float, float, float] | None = None
    steps = []
    while len(skip) < layers - 1:
        scored, layer = max(
            ((score(sorted(skip + [i])), i) for i in range(layers) if i not in skip),
            key=lambda item: (item[0][0], -item[1]),
        )
        if best is not None and scored[0] <= best[0]:
            break
        skip, best = sorted(skip + [layer]), scored
        steps.append({"layer": layer, "agreement": scored[1], "tau": scored[2], "predicted_speedup": scored[0]})
    c = fixed_share + (1 - fixed_share) * (layers - len(skip)) / layers
    return SkipPlan(skip, k, best[1], best[2], best[0], c, r, fixed_share, METHOD, described, steps)


def write_plan(plan: SkipPlan, where: str | Path) -> Path:
    """Save the plan as `where`/layerskip.json, where `LayerSkip.from_checkpoint` reads it, or as `where` itself if it
    names a .json file (which `--skip FILE.json` reads)."""
    file = Path(where) if str(where).endswith(".json") else Path(where) / PLAN_FILE
    file.write_text(json.dumps(asdict(plan), indent=2) + "\n")
    return file
