"""Quantized self-speculation: the target drafts for itself with its own weights requantized lower (a Q4_0 twin of a
bfloat16 or Q8_0 target, say), optionally with some of its layers left out as well. One tokenizer by construction.

The twin (models/twin.py) is a draft model like any other, so the draft model's drafter runs it: its greedy chains as
one program, trees with `branch`, sampled chains with their q, and the batched engine's drafting.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from verispec.drafters.draft_model import DraftModel
from verispec.drafters.layer_skip import read_plan
from verispec.drafters.options import FIXED_K, SelfQuantOptions
from verispec.errors import IncompatibleTargetError
from verispec.models.native import NativeModel
from verispec.models.protocol import CausalLM
from verispec.models.twin import TwinFormat, quantized_twin


class SelfQuant(DraftModel):
    """`DraftModel` over a quantized twin of `target`; it drafts for that target only."""

    name = "selfquant"

    def __init__(
        self,
        target: NativeModel,
        spec: TwinFormat = TwinFormat(),
        k: int = FIXED_K,
        branch: int = SelfQuantOptions.branch,
        branch_depth: int = SelfQuantOptions.branch_depth,
    ) -> None:
        super().__init__(quantized_twin(target, spec), k, branch, branch_depth)
        self.spec, self._weights, self._of = spec, target.module, target.name
        self.needs = replace(self.needs, twin=True)

    def check(self, target: CausalLM) -> None:
        if getattr(target, "module", None) is not self._weights:
            raise IncompatibleTargetError(
                f"this selfquant drafter's twin is made of {self._of}'s weights; it drafts "
                f"for that target only, not for {target.name}"
            )
        super().check(target)


def skip_option(value: Sequence[int] | str | Path) -> list[int]:
    """The `skip` option: layer indices, or a layer-skip plan's file (`verispec search-layerskip` writes one)."""
    return read_plan(value)[0] if isinstance(value, (str, Path)) else list(value)
