"""The corpus: the running interpreter's standard library `.py` files, split by a hash of their path.

The manifest (relative path, sha256, split) is committed, so the split is reproducible and benchmark prompts
come only from files that no model saw in training.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

SPLITS = ("train", "validation", "benchmark")
MANIFEST = Path(__file__).resolve().parents[2] / "data" / "stdlib_manifest.jsonl"


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the standard library's folder, with forward slashes
    sha256: str
    split: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(path: str) -> str:
    """About 90 / 5 / 5 by a hash of the relative path, so a file keeps its split when others change."""
    bucket = int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "benchmark"


def build_manifest(root: Path | None = None) -> list[Entry]:
    root = root or stdlib_root()
    entries = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or not file.is_file():
            continue
        entries.append(Entry(rel, hashlib.sha256(file.read_bytes()).hexdigest(), split_of(rel)))
    return entries


def write_manifest(entries: list[Entry], path: Path = MANIFEST) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(e)) + "\n" for e in entries))


def read_manifest(path: Path = MANIFEST) -> list[Entry]:
    return [Entry(**json.loads(line)) for line in path.read_text().splitlines() if line]


def load_split(split: str, manifest: Path = MANIFEST, root: Path | None = None) -> tuple[list[str], int]:
    """Texts of one split whose content still matches the manifest; also how many were missing or changed."""
    files, skipped = load_files(split, manifest, root)
    return [text for _, text in files], skipped


def load_files(split: str, manifest: Path = MANIFEST, root: Path | None = None) -> tuple[list[tuple[str, str]], int]:
    """(relative path, text) of one split's files that still match the manifest; also how many did not."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    root, texts, skipped = root or stdlib_root(), [], 0
    for entry in read_manifest(manifest):
        if entry.split != split:
            continue
        file = root / entry.path
        data = file.read_bytes() if file.is_file() else b""
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            skipped += 1
            continue
        texts.append((entry.path, data.decode("utf-8", errors="replace")))
    return texts, skipped
