"""A base for the tests' own drafters: each is its own session, started by `start`."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from verispec.drafters.base import DraftContext, Needs, check_target
from verispec.generate import generate
from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams


class OwnSession:
    """A drafter that is its own (single) session: fine for a test that runs one generation at a time."""

    needs = Needs()

    def check(self, target: CausalLM) -> None:
        """Any target."""

    def begin(self, context: DraftContext) -> OwnSession:
        self.start(context)
        return self

    def start(self, context: DraftContext) -> None:
        """Reset per-generation state."""


def start_session(
    drafter,
    target: CausalLM,
    prompt,
    sampling: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    cache=None,
):
    """A drafter's session for `prompt`, begun the way the loop begins one (checks first, then a prefilled cache)."""
    check_target(drafter, target)
    cache = target.new_cache() if cache is None else cache
    layers, hidden = drafter.needs.hidden_states, None
    if cache.length == 0 and len(prompt) > 1:
        out = target(torch.tensor([list(prompt)[:-1]]), cache, **({"hidden": layers} if layers else {}))
        hidden = out[1][0] if layers else None
    return drafter.begin(DraftContext(target, list(prompt), sampling or SamplingParams(), generator, cache, hidden))


def sampled_pairs(target: CausalLM, drafter, prompt: list[int], draws: int) -> tuple[np.ndarray, int]:
    """Counts (V, V) of the first two new tokens over `draws` seeded generations at temperature 1, and how many of the
    first tokens were drafted (for the distribution tests on an enumerable target)."""
    counts, drafted = np.zeros((target.vocab_size, target.vocab_size)), 0
    for seed in range(draws):
        out = generate(target, prompt, drafter, max_new_tokens=2, temperature=1.0, seed=seed, ignore_eos=True)
        counts[out.tokens[0], out.tokens[1]] += 1
        drafted += out.drafted[0]
    return counts, drafted


def break_the_rule_for(monkeypatch, top_k: int) -> None:
    """Make the batched acceptance rule raise for the rows sampled with this `top_k` (a marker), as a sampler
    given a broken distribution would."""
    import verispec.engine.batch_step as batch_step

    real = batch_step.verify

    def verify(proposal, q, logits, sampling, generator):
        if sampling.top_k == top_k:
            raise RuntimeError("invalid probability distribution")
        return real(proposal, q, logits, sampling, generator)

    monkeypatch.setattr(batch_step, "verify", verify)


def in_threads(work, arguments: list) -> None:
    """`work(argument)` for each argument, each in its own thread, all at once, with the interpreter switching
    threads as often as it can (so that unsynchronised state shows)."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(argument,)) for argument in arguments]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)


def last_two_of_four(folder, prompt: list[int], vocab: int, reference_probs) -> np.ndarray:
    """The exact joint (V, V) of the third and fourth new tokens sampled at temperature 1 after `prompt` from the
    checkpoint in `folder`, by the numpy reference over every three-token prefix."""
    prefixes = list(itertools.product(range(vocab), repeat=3))
    probs = reference_probs(folder, np.array([prompt + list(p) for p in prefixes]))  # (V^3, len + 3, V)
    n, joint = len(prompt), np.zeros((vocab,) * 4)
    for row, p in enumerate(prefixes):
        joint[p] += probs[row, n - 1, p[0]] * probs[row, n, p[1]] * probs[row, n + 1, p[2]] * probs[row, n + 2]
    return joint.sum(axis=(0, 1))
