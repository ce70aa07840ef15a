"""What ships in `models/` beside the package: the default pair (a target and its draft, trained on the Python
standard library) and the drafting heads made for a target, found by its fingerprint."""

from __future__ import annotations

from pathlib import Path

from verispec.checkpoints.draft_vocab import head_section
from verispec.checkpoints.fingerprint import gguf_fingerprint
from verispec.checkpoints.gguf_file import is_gguf
from verispec.errors import CheckpointError

MODELS = Path(__file__).resolve().parents[2] / "models"  # beside the package in a clone (pip install -e .)
DEFAULT_TARGET = MODELS / "stdlib-target"
DEFAULT_DRAFT = MODELS / "stdlib-draft"


def default_paths() -> tuple[Path, Path]:
    """The shipped target and draft folders; a clear error where this install has no `models/`."""
    for folder in (DEFAULT_TARGET, DEFAULT_DRAFT):
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"default model {folder} is missing: install verispec from a clone "
                "(pip install -e .), or pass --target/--draft"
            )
    return DEFAULT_TARGET, DEFAULT_DRAFT


def shipped_head_for(target: Path, kind: str, models: Path | None = None) -> Path | None:
    """The head of `kind` under `models/` made for the GGUF file `target`: the one whose config.json
    (verispec.target_match) holds the file's fingerprint (checkpoints/fingerprint.py), never matched by path."""
    models = models or MODELS
    folders = sorted(models.iterdir()) if models.is_dir() else []  # (an install without models/ ships none)
    sections = {folder: head_section(folder) for folder in folders if folder.is_dir()}
    made_for = {folder: s.get("target_match") for folder, s in sections.items() if s.get("drafter") == kind}
    matches = {folder: match for folder, match in made_for.items() if match is not None}
    if not matches:  # (the fingerprint reads the file's whole vocabulary: not at every start for nothing)
        return None
    identity = gguf_fingerprint(target)
    return next((folder for folder, match in matches.items() if match == identity), None)


def default_head(target_dir: Path | None, kind: str) -> Path:
    """The drafting head (`kind` "eagle" or "medusa") shipped for the target: the shipped target's own, or one made
    for a GGUF file's model (`shipped_head_for`); other targets name theirs."""
    folder = MODELS / f"stdlib-{kind}"
    if target_dir is not None and is_gguf(target_dir):
        found = shipped_head_for(Path(target_dir), kind)
        if found is None:
            raise CheckpointError(
                f"method {kind} needs its head's folder (--head DIR): no {kind} head in {MODELS} was "
                f"made for the model in {target_dir}"
            )
        return found
    if target_dir is None or Path(target_dir).resolve() != DEFAULT_TARGET.resolve():
        raise CheckpointError(
            f"method {kind} needs its head's folder (--head DIR) for a target other than the "
            f"shipped {DEFAULT_TARGET.name}"
        )
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"no {kind} head ships in {folder} yet: train one with `verispec train {kind}` and "
            "pass its folder with --head"
        )
    return folder
