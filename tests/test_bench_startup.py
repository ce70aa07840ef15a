"""`verispec bench --startup`: fresh processes timed from their start to one generated token, with their peak memory,
ours beside llama.cpp's (here a stand-in binary: the bench only times and reads its exit)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as GGML

from gguf_files import bpe_vocab, by_name, gguf_config, write_gguf
from verispec.bench.startup import CONTEXT, run_startup
from verispec.cli import main
from verispec.errors import InvalidArgumentError

ROW = r"\| {label} \| (\d+\.\d\d) \((\d+\.\d\d)-(\d+\.\d\d)\) \| (\d+) \((\d+)-(\d+)\) \| `[^`]*` \|"


def _stand_in(folder: Path, code: int = 0) -> Path:
    """A llama-completion that writes a line of log and exits with `code`."""
    folder.mkdir()
    binary = folder / "llama-completion"
    binary.write_text(f"#!/bin/sh\necho 'loading model' >&2\nexit {code}\n")
    binary.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    config = gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1)
    return write_gguf(tmp_path_factory.mktemp("startup") / "m.gguf", config, by_name({}, GGML.Q8_0))


def test_each_row_is_timed_and_its_memory_taken(tiny_gguf, tmp_path) -> None:
    report = run_startup(
        tiny_gguf, tmp_path / "out", "verispec bench --startup", repeats=2, llama_cpp=_stand_in(tmp_path / "bin")
    ).read_text()
    ours, theirs = re.search(ROW.format(label="verispec"), report), re.search(ROW.format(label="llama.cpp"), report)
    assert ours and theirs, report
    seconds, low, high = map(float, ours.groups()[:3])
    assert 0 < low <= seconds <= high and int(ours.group(4)) > 100  # a Python process with torch: > 100 MB
    assert float(theirs.group(1)) < seconds  # the stand-in does nothing
    assert f"-c {CONTEXT} --no-warmup" in report and "verispec against llama.cpp: " in report


def test_a_failing_row_and_a_folder_with_llama_cpp_are_refused(tiny_gguf, tmp_path, pair_dirs, capsys) -> None:
    with pytest.raises(InvalidArgumentError, match="llama-completion exited with 3: loading model"):
        run_startup(tiny_gguf, tmp_path / "a", "x", repeats=1, llama_cpp=_stand_in(tmp_path / "bin", code=3))
    assert (
        main(
            [
                "bench",
                "--startup",
                "--target",
                str(pair_dirs[0]),
                "--llama-cpp",
                str(tmp_path / "bin"),
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "times a GGUF file" in err
