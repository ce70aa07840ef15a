"""Writing a checkpoint as GGUF for llama.cpp: names, types, the RoPE row order, the tokenizer, and what is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from verispec.bench.gguf_export import write_gguf
from verispec.checkpoints.draft_vocab import OLD_VOCAB_FILE, save_draft_vocab
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.errors import CheckpointError, UnsupportedArchitectureError

SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "models" / "stdlib-draft"
LAYER_PARTS = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny grouped-query Llama (4 heads, 2 KV heads) with an untied LM head, as random_checkpoint writes it."""
    return random_checkpoint(tmp_path_factory.mktemp("llama"), tiny_config())


def _read(path):
    reader = gguf.GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def _field(reader, key):
    return reader.fields[key].contents()


def test_float32_keeps_every_tensor_and_reorders_the_rope_rows(checkpoint, tmp_path) -> None:
    reader, tensors = _read(write_gguf(checkpoint, tmp_path / "m.gguf", "float32"))
    assert set(tensors) == {"token_embd.weight", "output.weight", "output_norm.weight"} | {
        f"blk.{i}.{part}.weight" for i in range(2) for part in LAYER_PARTS
    }
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    hf = load_file(checkpoint / "model.safetensors")
    assert np.array_equal(tensors["blk.1.ffn_gate.weight"].data, hf["model.layers.1.mlp.gate_proj.weight"].numpy())
    head_dim = 16  # 64 / 4 heads
    for name, hf_name, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
        ours, theirs = hf[f"model.layers.0.self_attn.{hf_name}.weight"].numpy(), tensors[f"blk.0.{name}.weight"].data
        assert theirs.shape == ours.shape
        for h in range(heads):  # llama.cpp rotates rows (2i, 2i+1) of a head where Hugging Face rotates (i, i + d/2)
            base = h * head_dim
            for i in range(head_dim // 2):
                assert np.array_equal(theirs[base + 2 * i], ours[base + i])
                assert np.array_equal(theirs[base + 2 * i + 1], ours[base + i + head_dim // 2])
    assert _field(reader, "llama.attention.head_count") == 4 and _field(reader, "llama.attention.head_count_kv") == 2
    assert _field(reader, "llama.block_count") == 2 and _field(reader, "llama.context_length") == 256
    assert _field(reader, "llama.rope.dimension_count") == head_dim


def test_half_precision_matrices_and_float32_norms(checkpoint, tmp_path) -> None:
    hf = load_file(checkpoint / "model.safetensors")
    for dtype, qtype in (("bfloat16", gguf.GGMLQuantizationType.BF16), ("float16", gguf.GGMLQuantizationType.F16)):
        _, tensors = _read(write_gguf(checkpoint, tmp_path / f"{dtype}.gguf", dtype))
        assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        up = tensors["blk.0.ffn_up.weight"]
        assert up.tensor_type == qtype
        expected = hf["model.layers.0.mlp.up_proj.weight"].to(getattr(torch, dtype)).float().numpy()
        assert np.array_equal(gguf.quants.dequantize(up.data, qtype).reshape(expected.shape), expected)


def test_tokenizer_is_written_as_gpt2_byte_level_bpe_without_bos(checkpoint, tmp_path) -> None:
    reader, _ = _read(write_gguf(checkpoint, tmp_path / "m.gguf"))
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 257 and tokens[:256] == sorted(vocab, key=vocab.get) and tokens[256] == "<|endoftext|>"
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[256] == gguf.TokenType.CONTROL and set(types[:256]) == {gguf.TokenType.NORMAL}
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 256 and "tokenizer.ggml.bos_token_id" not in reader.fields
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False


def test_merges_are_written_in_order(tmp_path) -> None:
    folder = shutil.copytree(SHIPPED_DRAFT, tmp_path / "draft", ignore=shutil.ignore_patterns("*.safetensors"))
    random_checkpoint(tmp_path / "random", tiny_config(vocab_size=8192, num_hidden_layers=1))
    shutil.copy(tmp_path / "random" / "model.safetensors", folder)  # the shipped tokenizer on a tiny model
    config = json.loads((tmp_path / "random" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    reader, _ = _read(write_gguf(folder, tmp_path / "m.gguf"))
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert _field(reader, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m) for m in merges]


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda c, t: c.update(model_type="qwen2"), UnsupportedArchitectureError, "only Llama"),
        (
            lambda c, t: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            UnsupportedArchitectureError,
            "yarn",
        ),
        (lambda c, t: t.update(post_processor={"type": "TemplateProcessing"}), CheckpointError, "post-processor"),
        (lambda c, t: t["pre_tokenizer"].update(use_regex=False), CheckpointError, "GPT-2's pre-tokenizer"),
    ],
)
def test_what_llama_cpp_would_read_differently_is_refused(checkpoint, tmp_path, change, error, message) -> None:
    folder = shutil.copytree(checkpoint, tmp_path / "copy")
    config, tokenizer = (json.loads((folder / name).read_text()) for name in ("config.json", "tokenizer.json"))
    change(config, tokenizer)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(error, match=message):
        write_gguf(folder, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_float64_is_refused(checkpoint, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="float64"):
        write_gguf(checkpoint, tmp_path / "m.gguf", "float64")


def test_only_the_weights_files_are_read(checkpoint, tmp_path) -> None:
    """An older draft's folder holds its draft vocabulary beside the weights (draft_vocab.safetensors): not a weight."""
    folder = shutil.copytree(checkpoint, tmp_path / "copy")
    save_draft_vocab(folder, torch.arange(256)).rename(folder / OLD_VOCAB_FILE)
    _, tensors = _read(write_gguf(folder, tmp_path / "m.gguf"))
    assert "ids" not in tensors and "token_embd.weight" in tensors
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no such weights file"):
        write_gguf(folder, tmp_path / "n.gguf")
