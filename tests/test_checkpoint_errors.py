"""Checkpoints that are not what they claim are refused at load, on both backends, through the API and the CLI.

Each bad checkpoint is a tiny random Llama folder, damaged in one way.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.utils import logging as hf_logging

from verispec import CheckpointError, load
from verispec.checkpoints import folder as hf_folder
from verispec.checkpoints.config import read_config
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.checkpoints.tokenizer import byte_level_tokenizer
from verispec.cli import main


def _checkpoint(tmp_path: Path, **config) -> Path:
    return random_checkpoint(tmp_path / "model", tiny_config(num_hidden_layers=1, **config))


def _edit_config(folder: Path, **changes) -> None:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | changes))


def _edit_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _deny(monkeypatch: pytest.MonkeyPatch, denied: Path) -> None:
    """The OS refuses to open `denied`, as it refuses a non-root user a mode-000 file or folder.

    The tests run as root, whom chmod does not stop, so the refusal is simulated at the two system calls that open
    files and folders (os.open, os.scandir); every other path goes through to the real call.
    """

    def guard(real: Callable) -> Callable:
        def call(path=".", *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path) == denied:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "open", guard(os.open))
    monkeypatch.setattr(os, "scandir", guard(os.scandir))


def llama_weights_under_gpt2_config(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _edit_config(
        folder, model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=1, n_head=4, n_positions=256
    )
    return folder


def layer_missing(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    def drop_layer_1(weights: dict[str, torch.Tensor]) -> None:
        for name in [name for name in weights if name.startswith("model.layers.1.")]:
            del weights[name]

    folder = random_checkpoint(tmp_path / "model", tiny_config(num_hidden_layers=2))
    _edit_weights(folder, drop_layer_1)
    return folder


def truncated(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


def wrong_shape(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _edit_weights(folder, lambda w: w.update({"model.norm.weight": torch.ones(32)}))
    return folder


def zero_heads(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _edit_config(folder, num_attention_heads=0)  # transformers divides by it
    return folder


def extra_layer(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    """Weights of two layers under a config of one: the native runtime would run half the model."""
    folder = random_checkpoint(tmp_path / "model", tiny_config(num_hidden_layers=2))
    _edit_config(folder, num_hidden_layers=1)
    return folder


def nan_weight(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _edit_weights(folder, lambda w: w["model.layers.0.mlp.up_proj.weight"].view(-1).__setitem__(7, float("nan")))
    return folder


def inf_weight(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _edit_weights(folder, lambda w: w["model.norm.weight"].__setitem__(0, float("inf")))
    return folder


def too_big_for_float16(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _edit_weights(folder, lambda w: w["model.norm.weight"].__setitem__(0, 1e6))  # finite in float32, inf in float16
    return folder


def tokenizer_larger_than_table(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens(["<|pad|>", "<|sep|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def folder_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _deny(monkeypatch, folder)
    return folder


def weights_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = _checkpoint(tmp_path)
    _deny(monkeypatch, folder / "model.safetensors")
    return folder


NAN = r"weight .* holds NaN or infinite values \(in torch.float32\)"
# case: (how the folder is damaged, backend, dtype, what the error says)
CASES = {
    "llama_weights_under_gpt2_config": (
        llama_weights_under_gpt2_config,
        "auto",
        "float32",
        r"16 missing \(transformer\..*; 11 unexpected \(model\.embed_tokens",
    ),
    "layer_missing": (layer_missing, "transformers", "float32", r"9 missing \(model\.layers\.1\."),
    "truncated": (truncated, "transformers", "float32", r"transformers cannot load it \(SafetensorError"),
    "wrong_shape": (
        wrong_shape,
        "transformers",
        "float32",
        r"model\.norm\.weight has shape \(32,\), LlamaForCausalLM expects \(64,\)",
    ),
    "config_rejected": (zero_heads, "transformers", "float32", r"transformers cannot load it \(ZeroDivisionError"),
    "extra_layer_native": (
        extra_layer,
        "native",
        "float32",
        r"9 weights the config does not describe: model\.layers\.1",
    ),
    "nan_native": (nan_weight, "native", "float32", NAN),
    "nan_transformers": (nan_weight, "transformers", "float32", NAN),
    "inf_native": (inf_weight, "native", "float32", NAN),
    "inf_transformers": (inf_weight, "transformers", "float32", NAN),
    "float16_overflow": (too_big_for_float16, "native", "float16", r"model\.norm\.weight .*\(in torch\.float16\)"),
    "tokenizer_native": (
        tokenizer_larger_than_table,
        "native",
        "float32",
        r"tokenizer has 259 tokens but the model's embedding table only 257 rows",
    ),
    "tokenizer_transformers": (
        tokenizer_larger_than_table,
        "transformers",
        "float32",
        r"tokenizer has 259 tokens but the model's embedding table only 257 rows",
    ),
    "folder_unreadable": (folder_unreadable, "auto", "float32", r"model: permission denied"),
    "weights_unreadable_native": (weights_unreadable, "native", "float32", r"model\.safetensors: permission denied"),
    "weights_unreadable_transformers": (
        weights_unreadable,
        "transformers",
        "float32",
        r"model\.safetensors: permission denied",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_is_a_checkpoint_error(tmp_path, monkeypatch, case) -> None:
    damage, backend, dtype, message = CASES[case]
    with pytest.raises(CheckpointError, match=message):
        load(damage(tmp_path, monkeypatch), backend, dtype=dtype)


@pytest.mark.parametrize("case", CASES)
def test_cli_answers_one_line_and_exit_2(tmp_path, monkeypatch, capfd, case) -> None:
    damage, backend, dtype, message = CASES[case]
    code = main(
        [
            "generate",
            "p",
            "--target",
            str(damage(tmp_path, monkeypatch)),
            "--backend",
            backend,
            "--dtype",
            dtype,
            "--max-new-tokens",
            "2",
        ]
    )
    out, err = capfd.readouterr()  # file-descriptor level: a progress bar or load report would show here
    assert code == 2 and out == ""
    assert err.startswith("verispec: error:") and err.count("\n") == 1
    assert re.search(message, err)


def test_unreadable_weights_are_not_called_corrupt(tmp_path, monkeypatch) -> None:
    """Should the file become unreadable after the entry check, the reader still says why."""
    folder = _checkpoint(tmp_path)

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(hf_folder, "load_file", denied)
    with pytest.raises(CheckpointError, match="permission denied") as caught:
        hf_folder.load_weights(folder, read_config(folder))
    assert "corrupt" not in str(caught.value)


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_table_padded_past_the_tokenizer_is_fine(tmp_path, backend) -> None:
    model = load(_checkpoint(tmp_path, vocab_size=300), backend)
    assert model.vocab_size == 257


def test_transformers_loads_quietly_and_restores_its_logging(tmp_path, capfd) -> None:
    folder = _checkpoint(tmp_path)
    before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    load(folder, "transformers")
    assert capfd.readouterr().err == ""  # no "Loading weights" bar, no load report
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before


def test_saved_rotary_frequencies_are_not_unexpected_weights(tmp_path) -> None:
    """Older exports saved each layer's rotary frequencies; they are recomputed from the config, not a sign of
    another model."""
    folder = _checkpoint(tmp_path)
    _edit_weights(folder, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert load(folder, "native").vocab_size == 257
