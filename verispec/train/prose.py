"""Prose and dialogue for head training, from Debian's documentation packages (fetched by `apt-get download` when
the data is prepared, never at test time), as plain-text documents split by a hash of their name.

Packages and licences: python3.11-doc (the Python documentation's reStructuredText sources, PSF licence),
debian-handbook (GPL-2+ or CC-BY-SA-3.0), debian-reference-en (GPL-2+), developers-reference (GPL-2), fortunes and
fortunes-min (quotations and short dialogues; BSD-style).
"""

from __future__ import annotations

import gzip
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

from verispec.errors import VerispecError
from verispec.train.corpus import split_of

PACKAGES = (
    "python3.11-doc",
    "debian-handbook",
    "debian-reference-en",
    "developers-reference",
    "fortunes",
    "fortunes-min",
)


class DataError(VerispecError):
    """Training data could not be fetched or read."""


def fetch(debs: Path, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    """The packages' .deb files in `debs`, downloaded by `apt-get download` where missing."""
    debs.mkdir(parents=True, exist_ok=True)
    missing = [name for name in packages if not list(debs.glob(f"{name}_*.deb"))]
    if missing:
        done = subprocess.run(["apt-get", "download", *missing], cwd=debs, capture_output=True, text=True)
        if done.returncode:
            raise DataError(f"apt-get download {' '.join(missing)} failed: {done.stderr.strip()[-300:]}")
    return [next(debs.glob(f"{name}_*.deb")) for name in packages]


def extract(deb: Path, root: Path) -> Path:
    """The package's files under root/NAME (dpkg-deb -x), once."""
    folder = root / deb.name.split("_")[0]
    if not folder.is_dir():
        tmp = folder.parent / f"{folder.name}.tmp"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
        tmp.rename(folder)
    return folder


class _Text(HTMLParser):
    """The visible text of an HTML page: blocks as paragraphs, scripts and styles dropped."""

    BLOCKS = {"p", "div", "li", "pre", "h1", "h2", "h3", "h4", "h5", "tr", "br", "dt", "dd", "table", "section"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        self.skip += tag in ("script", "style")
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        self.skip -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.parts.append(data)


def html_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return tidy("".join(parser.parts))


def tidy(text: str) -> str:
    """Runs of spaces folded, paragraphs kept apart by one blank line."""
    paragraphs = (" ".join(block.split()) for block in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)\s*(?:<[^`>]*>)?`")  # :func:`name` and :ref:`text <target>` -> their text


def rst_text(source: str) -> str:
    """reStructuredText with its roles reduced to their text and its directive lines dropped."""
    lines = [line for line in ROLE.sub(r"\1", source).splitlines() if not line.lstrip().startswith(".. ")]
    return "\n".join(lines)


def _fortunes(folder: Path, group: int = 40) -> Iterator[tuple[str, str]]:
    for file in sorted((folder / "usr/share/games/fortunes").glob("*")):
        if file.suffix or file.is_dir() or file.is_symlink():
            continue
        items = [item.strip() for item in file.read_text(errors="replace").split("\n%\n") if item.strip()]
        for i in range(0, len(items), group):
            yield f"{folder.name}/{file.name}/{i}", "\n\n".join(items[i : i + group])


def documents(folder: Path) -> Iterator[tuple[str, str]]:
    """(name, text) of one extracted package's documents."""
    name = folder.name
    if name == "python3.11-doc":
        for file in sorted(folder.glob("usr/share/doc/python3.11/html/_sources/**/*.rst.txt")):
            yield f"{name}/{file.relative_to(folder)}", tidy(rst_text(file.read_text(errors="replace")))
    elif name in ("debian-handbook", "developers-reference"):
        pattern = (
            "usr/share/doc/debian-handbook/html/en-US/*.html"
            if name == "debian-handbook"
            else "usr/share/developers-reference/*.html"
        )
        for file in sorted(folder.glob(pattern)):
            yield f"{name}/{file.name}", html_text(file.read_text(errors="replace"))
    elif name == "debian-reference-en":
        text = gzip.decompress((folder / "usr/share/debian-reference/debian-reference.en.txt.gz").read_bytes())
        for i, chapter in enumerate(re.split(r"^(?=Chapter\s\d+\.\s)", text.decode(errors="replace"), flags=re.M)):
            yield f"{name}/{i}", chapter
    elif name.startswith("fortunes"):
        yield from _fortunes(folder)
    else:
        raise DataError(f"no reader for package {name}")


def prose_split(root: Path, split: str, debs: Path | None = None) -> list[tuple[str, str]]:
    """(name, text) of every document of the packages in `split` (train, validation or benchmark, by a hash of the
    document's name); the .deb files are fetched into `debs` (default root/debs) and extracted under root once."""
    docs = []
    for deb in fetch(debs or root / "debs"):
        docs += [(n, t) for n, t in documents(extract(deb, root / "extracted")) if split_of(n) == split and t.strip()]
    return docs


def paragraphs(docs: list[tuple[str, str]], shortest: int = 300, longest: int = 1200) -> list[str]:
    """Paragraphs of ordinary prose (not code, not lists) of a readable length, for summary and question prompts."""
    out = []
    for _, text in docs:
        for block in text.split("\n\n"):
            block = " ".join(block.split())
            if shortest <= len(block) <= longest and block.count(". ") >= 2 and not re.search(r"[{}<>$=_]|::", block):
                out.append(block)
    return out
