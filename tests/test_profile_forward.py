"""`verispec bench --profile` and the weight-read floor: what a 1-token forward reads, and where its time goes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from gguf_files import bpe_vocab, by_name, gguf_config, write_gguf
from verispec import kernels
from verispec.bench import profile_forward
from verispec.bench.bandwidth import weight_bytes
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main
from verispec.models.native import load_model
from verispec.models.precision import formats


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_what_a_forward_reads(tmp_path: Path, tied: bool) -> None:
    model = load_model(random_checkpoint(tmp_path, tiny_config(tie_word_embeddings=tied)), dtype="bfloat16")
    c = model.config
    embedding = c.vocab_size * c.hidden_size
    params = sum(p.numel() for p in model.module.parameters())  # a tied table once
    assert weight_bytes(model) == 2 * (params if tied else params - embedding)


@pytest.mark.parametrize("own", [True, False], ids=["own-kernels", "torch-kernels"])
def test_profile_labels_every_kind_of_work(pair_dirs, own: bool) -> None:
    if own and not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    setting = profile_forward._Setting(
        profile_forward._load(pair_dirs[0], "float32", False, "own" if own else "fast"), context=8
    )
    setting.time(2)
    setting.profile()
    wall, kinds = setting.result()
    assert wall > 0 and list(kinds) == profile_forward.ORDER
    matmuls = [kind for kind in kinds if kind.startswith("matmul")]
    attention = profile_forward.BY_CLASS[profile_forward.llama.Attention]
    assert len(matmuls) == 5 and all(kinds[kind] > 0 for kind in [*matmuls, "rotary", "norms", attention])


def test_a_gguf_files_own_blocks_are_profiled_too(tmp_path: Path) -> None:
    """A GGUF target adds the settings of its own block formats (what `--dtype auto` runs), labelled as the others."""
    if not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    config = gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1)
    path = write_gguf(tmp_path / "m.gguf", config, by_name({}, GGML.Q4_0))
    model = profile_forward._load(path, profile_forward.FILE, False, "own")
    assert "q4_0" in formats(model.module)
    setting = profile_forward._Setting(model, context=8)
    setting.time(2)
    setting.profile()
    _, kinds = setting.result()
    assert all(kinds[kind] > 0 for kind in kinds if kind.startswith("matmul"))


def test_bench_profile_writes_every_setting(tmp_path: Path, pair_dirs, capsys, monkeypatch) -> None:
    monkeypatch.setattr(
        profile_forward,
        "profile_all",
        lambda target_dir, rounds: ORIGINAL(target_dir, context=8, rounds=2, per_round=1),
    )
    assert main(["bench", "--profile", "--target", str(pair_dirs[0]), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "forward-profile.md").read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    for dtype in ("float32", "bfloat16"):
        for mode in ("ordinary", "exact"):
            assert f"| {dtype} {mode} plain |" in text and f"| {dtype} {mode} fast |" in text
            assert (f"| {dtype} {mode} own |" in text) == kernels.available(torch.float32)
    assert "Read bandwidth:" in text and "weight-read time" in text and "| matmul LM head |" in text


ORIGINAL = profile_forward.profile_all
