"""The default pair that ships in `models/`: a target and its draft, trained on the Python standard library."""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.errors import CheckpointError
from verispec.models.native import NativeModel, load_model

MODELS = Path(__file__).resolve().parents[2] / "models"  # beside the package in a clone (pip install -e .)
DEFAULT_TARGET = MODELS / "stdlib-target"
DEFAULT_DRAFT = MODELS / "stdlib-draft"


def default_paths() -> tuple[Path, Path]:
    """The shipped target and draft folders; a clear error where this install has no `models/`."""
    for folder in (DEFAULT_TARGET, DEFAULT_DRAFT):
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"default model {folder} is missing: install verispec from a clone "
                                  "(pip install -e .), or pass --target/--draft")
    return DEFAULT_TARGET, DEFAULT_DRAFT


def load_default(device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32", *,
                 exact: bool = False) -> tuple[NativeModel, NativeModel]:
    """`target, draft = verispec.load_default()`: the shipped pair, upcast to float32 by default. `exact` is the
    target's mode (see `NativeModel`); the draft runs ordinarily either way, since the target decides every token."""
    target_dir, draft_dir = default_paths()
    return load_model(target_dir, device, dtype, exact=exact), load_model(draft_dir, device, dtype)


def default_head(target_dir: Path | None, kind: str) -> Path:
    """The drafting head (`kind` "eagle" or "medusa") shipped for the shipped target; other targets name theirs."""
    folder = MODELS / f"stdlib-{kind}"
    if target_dir is None or Path(target_dir).resolve() != DEFAULT_TARGET.resolve():
        raise CheckpointError(f"method {kind} needs its head's folder (--head DIR) for a target other than the "
                              f"shipped {DEFAULT_TARGET.name}")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"no {kind} head ships in {folder} yet: train one with `verispec train {kind}` and "
                              "pass its folder with --head")
    return folder
