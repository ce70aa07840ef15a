"""Logits -> probabilities (temperature, top-k, top-p), and probabilities -> token; nothing else."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verispec.argument_checks import real_number, whole_number
from verispec.errors import InvalidArgumentError
from verispec.models.greedy import argmax

# Below this a temperature decodes greedily, as in vLLM: dividing float32 logits by it would overflow, or by a value
# that rounds to 0 in float32 give 0/0, while the distribution it asks for is already the argmax (up to exact ties).
GREEDY_TEMPERATURE = 1e-5
# The least top_p taken: float32's smallest normal number. Smaller values round to 0 (or a denormal) in the float32
# the filter runs in, which would drop every token; any top_p below 1/V keeps the top token alone anyway.
LEAST_TOP_P = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy decoding (so does any temperature below `GREEDY_TEMPERATURE`, which is stored as 0);
    top_k 0 and top_p 1 switch those filters off; top_p below `LEAST_TOP_P` is refused."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # Stored as plain float/int, so numpy scalars in and strings out are settled here and nowhere else.
        object.__setattr__(self, "temperature", real_number(self.temperature, "temperature"))
        object.__setattr__(self, "top_k", whole_number(self.top_k, "top_k (0 disables it)"))
        object.__setattr__(self, "top_p", real_number(self.top_p, "top_p"))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not LEAST_TOP_P <= self.top_p <= 1:
            raise InvalidArgumentError(
                f"top_p must be in [{LEAST_TOP_P:.4g}, 1] (float32's smallest normal number: "
                f"less rounds to 0), got {self.top_p}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def constrain(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """A grammar's transform, before every other: the tokens it forbids (`allowed` False, (..., V) bool) get logit
    -inf, so probability 0, and the softmax renormalises the rest; greedy decoding takes the argmax among the allowed.
    Applied alike to the target's p and the draft's q (verispec/constraint.py). None: no grammar."""
    return logits if allowed is None else logits.masked_fill(~allowed, -math.inf)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (..., V) after temperature, top-k and top-p; float32 or wider.

    Temperature 0 is the greedy limit: all the mass on the argmax.
    """
    if params.greedy:
        onehot = torch.zeros_like(logits, dtype=torch.promote_types(logits.dtype, torch.float32))
        return onehot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # Subtracting the max first keeps a tiny temperature from overflowing to inf - inf.
    logits = (logits - logits.max(-1, keepdim=True).values) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the more likely ones already hold top_p of the mass; the first always stays.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `probs` (..., V)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[int, torch.Tensor | None]:
    """A drafter's next token from its logits (V,): the argmax when greedy (no q needed), else a sample and its q."""
    if params.greedy:
        return int(argmax(logits)), None
    q = logits_to_probs(logits, params)
    return int(sample(q, generator)), q


def seeded_generator(device: torch.device | str, seed: int | None) -> torch.Generator:
    """The generator one generation draws from: seeded with `seed`, or from the OS when it is None."""
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
