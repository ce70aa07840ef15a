"""`verispec bench --formats`: the 1-token step and r(n) in every weight format, beside its weight-read time."""

from __future__ import annotations

import pytest
import torch

from verispec import kernels
from verispec.bench import formats
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main


@pytest.mark.skipif(not kernels.available(torch.float32), reason=f"no kernels here: {kernels.reason()}")
def test_bench_formats_writes_every_format_with_its_r_of_n(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(formats, "WIDTHS", (1, 2, 3))  # a tiny model: three widths do
    folder = random_checkpoint(tmp_path / "m", tiny_config())
    assert main(
        [
            "bench",
            "--formats",
            "--target",
            str(folder),
            "--out",
            str(tmp_path / "out"),
            "--repeats",
            "1",
            "--threads",
            "2",
        ]
    ) in (0, None)
    text = (tmp_path / "out" / "formats.md").read_text()
    assert (
        "| format | linears | cache | weights (MB) | weight-read (ms) | 1-token step (ms) | step / read | r(2) | "
        "r(3) |" in text
    )
    one, two = text.split("## 1 thread\n")[1].split("## 2 threads\n")  # a section at each count, each its bandwidth
    for section in (one, two):
        assert section.lstrip().startswith("Read bandwidth: ")
        table = section.split("\n\n")[1]  # the table of steps and r(n)
        rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| format")]
        assert [row.split(" | ")[0] for row in rows] == [
            "| float32",
            "| bfloat16",
            "| q8_0",
            "| q4_0",
            "| q4_1",
            "| q5_0",
            "| q5_1",
        ]
    assert "q4_1 x 14, q8_0 x 1 | float16 |" in text and "bfloat16 x 15 | bfloat16 |" in text
    assert capsys.readouterr().out.startswith("# Forward by weight format")
    assert "| q4_1 |" in text.split("by kernel |")[1] and "linear_q4_1 " in text and "attend_f32_f16 " in text
