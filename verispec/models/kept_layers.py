"""Which blocks of a model run: a list of layers to skip, checked, and the blocks left (layer skip, a quantized
twin with layers left out)."""

from __future__ import annotations

from numbers import Integral
from typing import Any

from verispec.errors import IncompatibleTargetError, InvalidArgumentError
from verispec.models.protocol import CausalLM


def layer_indices(values: Any, name: str = "layers to skip") -> list[int]:
    """Distinct non-negative block indices (any integer types but bool), sorted."""
    values = list(values) if isinstance(values, (list, tuple, range)) else values
    if not isinstance(values, list) or not all(
        isinstance(i, Integral) and not isinstance(i, bool) and i >= 0 for i in values
    ):
        raise InvalidArgumentError(f"{name} must be non-negative integers, got {values!r}")
    if len(set(values)) != len(values):
        raise InvalidArgumentError(f"{name} must be distinct, got {values}")
    return sorted(int(i) for i in values)


def kept_layers(skip: list[int], model: CausalLM) -> list[int]:
    """The blocks of `model` that run when those in `skip` (sorted, as `layer_indices` gives them) are left out; an
    `IncompatibleTargetError` where one is not in the model or none would be left."""
    if skip and skip[-1] >= model.num_layers:
        raise IncompatibleTargetError(
            f"cannot skip layer {skip[-1]}: {model.name} has layers 0..{model.num_layers - 1}"
        )
    if len(skip) == model.num_layers:
        raise IncompatibleTargetError(f"cannot skip all {model.num_layers} layers of {model.name}")
    return [i for i in range(model.num_layers) if i not in skip]
