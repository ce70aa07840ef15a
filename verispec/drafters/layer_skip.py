"""Self-speculative drafting: the target drafts for itself with some of its layers skipped.

No second model is held in memory, and the draft reuses the target's own KV cache: the committed prefix's
entries in the layers it runs are the full model's (as in Draft & Verify and SWIFT). Which layers to skip is
chosen by `verispec.bench.layer_skip_search` and saved as `layerskip.json` beside the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from verispec.argument_checks import whole_number
from verispec.drafters.base import DraftContext, Needs, Proposal, Verdict
from verispec.drafters.options import FIXED_K
from verispec.errors import CheckpointError, InvalidArgumentError
from verispec.models.kept_layers import kept_layers, layer_indices
from verispec.models.protocol import CausalLM
from verispec.sampling import draw

PLAN_FILE = "layerskip.json"


class LayerSkip:
    """Drafts k tokens autoregressively with the target's blocks `skip` left out.

    Each proposal writes its tokens' keys and values into the target's cache past the committed tokens (the
    skipped layers' slots stay stale and are never read by the layers that run), then truncates the cache
    back, so the verification forward overwrites those slots with the full model's entries.
    """

    name = "layerskip"
    batched = False  # it runs the target on one sequence's cache

    def __init__(self, skip: Sequence[int], k: int = FIXED_K) -> None:
        k = whole_number(k, "k (tokens drafted per step)", 1)
        skip = layer_indices(skip)
        if not skip:
            raise InvalidArgumentError(
                "layer skip needs at least one layer to skip (skipping none drafts with "
                "the full target, which is never faster)"
            )
        self.skip, self.k, self.width = skip, k, k
        self.needs = Needs(layer_subsets=True)

    @classmethod
    def from_checkpoint(cls, folder: str | Path, k: int | None = None) -> LayerSkip:
        """The skip set saved in `folder/layerskip.json` by the search; k defaults to the one searched for."""
        file = Path(folder) / PLAN_FILE
        if not file.is_file():
            raise CheckpointError(
                f"{file}: no layer-skip plan; write one with `verispec search-layerskip --target "
                f"{folder}` or pass --skip"
            )
        skip, saved_k = read_plan(file)
        return cls(skip, saved_k if k is None else k)

    def check(self, target: CausalLM) -> None:
        kept_layers(self.skip, target)

    def begin(self, context: DraftContext) -> LayerSkipSession:
        return LayerSkipSession(kept_layers(self.skip, context.target), context)


def read_plan(file: str | Path) -> tuple[list[int], int]:
    """The skip set and k of a layer-skip plan (`verispec search-layerskip` writes one as layerskip.json)."""
    file = Path(file)
    try:
        plan = json.loads(file.read_text())
        return list(plan["skip"]), int(plan["k"])
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such layer-skip plan") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{file}: not a layer-skip plan ({err})") from None


class LayerSkipSession:
    """Keeps nothing of its own past the committed tokens: every proposal leaves the target's cache as it found it."""

    def __init__(self, layers: list[int], context: DraftContext) -> None:
        self.layers, self.target, self.cache = layers, context.target, context.cache
        self.sampling, self.generator, self.grammar = context.sampling, context.generator, context.grammar

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        start, vocab = self.cache.length, self.target.vocab_size
        unseen = list(context[start:])  # the last committed token, which the cache does not hold yet
        k = min(k, self.cache.max_len - start - len(unseen) + 1)  # the last draft is never fed
        tokens, q = [], []
        try:
            for _ in range(k):
                x = torch.tensor([unseen], device=self.target.device)
                logits = self.target(x, self.cache, layers=self.layers)[0, -1, :vocab]
                if self.grammar is not None and (logits := self.grammar.constrain(logits, tokens)) is None:
                    break  # the grammar allows no token here (a vocabulary it cannot go on in)
                token, q_i = draw(logits, self.sampling, self.generator)
                tokens.append(token)
                q += [] if q_i is None else [q_i]
                unseen = [token]
        finally:  # the loop expects the cache where it left it; the verification rewrites these slots
            self.cache.truncate(start)
        return Proposal(tokens, torch.stack(q) if q else None)

    def accepted(self, verdict: Verdict) -> None:
        """Nothing to roll back."""
