"""Where a model's tensors go: a device checked at load, before any weight is read."""

from __future__ import annotations

from typing import Any

import torch

from verispec.errors import InvalidArgumentError


def usable_device(device: Any) -> torch.device:
    """A device torch can put data on here (not `meta`, which holds none)."""
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgumentError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        torch.empty(0, device=device)
        parsed = torch.device(device)
    except (RuntimeError, AssertionError) as err:  # torch asserts when CUDA is asked of a CPU-only build
        raise InvalidArgumentError(f"device {device!r} is not usable here ({err})") from None
    if parsed.type == "meta":
        raise InvalidArgumentError(f"device {device!r} is not usable here (it holds no data)")
    return parsed
