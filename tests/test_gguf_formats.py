"""A GGUF file's own formats kept (`dtype="auto"`), `--quantize`, and llama.cpp given the very blocks we run."""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from tests.gguf_files import SHIPPED_TOKENIZER, bpe_vocab, by_name, gguf_config, write_gguf
from verispec import kernels
from verispec.bench.gguf_export import write_gguf as export_folder
from verispec.checkpoints.blocks import FORMATS
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main
from verispec.models.native import load_model
from verispec.models.packed import packing
from verispec.models.precision import formats

needs_kernels = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)
TOKENS = torch.tensor([[5, 17, 200, 3, 99, 64, 7]])


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine (tests/test_pool.py takes every count)."""


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory) -> str:
    """q in Q4_0, k in Q4_1, v in Q5_0, o in Q5_1 (one fused matmul of mixed formats) but a Q5_K one, the rest Q8_0
    but two F16, a Q6_K and a Q4_K matrix, the LM head tied to a Q8_0 embedding."""
    types = by_name(
        {
            "layers.1.self_attn.o": GGML.Q5_K,
            "q_proj": GGML.Q4_0,
            "k_proj": GGML.Q4_1,
            "v_proj": GGML.Q5_0,
            "o_proj": GGML.Q5_1,
            "layers.1.mlp.up": GGML.F16,
            "layers.0.mlp.down": GGML.Q6_K,
            "layers.1.mlp.down": GGML.Q4_K,
        },
        GGML.Q8_0,
    )
    config = gguf_config(len(bpe_vocab()[0]), tie_word_embeddings=True)
    return str(write_gguf(tmp_path_factory.mktemp("q") / "model.gguf", config, types))


def logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    return model(tokens, model.new_cache())[0]


@needs_kernels
def test_auto_keeps_the_files_block_formats_and_stays_the_files_model(quantized_file: str) -> None:
    kept, plain = load_model(quantized_file, dtype="auto"), load_model(quantized_file, dtype="float32")
    layer = kept.module.model.layers[0]
    assert kept.dtype == torch.float32 and packing(kept.module).kernels
    assert (layer.self_attn.q_proj.quantized.format, layer.self_attn.k_proj.quantized.format) == ("q4_0", "q4_1")
    assert layer.mlp.gate_proj.quantized.format == "q8_0" and kept.module.lm_head.quantized.format == "q8_0"
    assert formats(kept.module) == {
        "q4_0": 2,
        "q4_1": 2,
        "q5_0": 2,
        "q5_1": 1,
        "q4_k": 1,
        "q5_k": 1,
        "q6_k": 1,
        "q8_0": 4,
        "float32": 1,
    }  # F16 as floats
    assert layer.self_attn.o.kernel.kernel == "linear_q5_1"
    assert kept.module.model.layers[1].self_attn.o.kernel.kernel == "linear_q5_k"
    assert kept.module.model.layers[1].mlp.down.kernel.kernel == "linear_q4_k"
    assert layer.mlp.down.kernel.kernel == "linear_q6_k"
    assert torch.equal(kept.module.model.embed_tokens.weight, plain.module.model.embed_tokens.weight)
    assert kept.module.model.layers[0].mlp.gate_up.kernel.kernel == "linear_q8_0"
    assert layer.self_attn.qkv.kernel.kernel == "linear_q4_0+linear_q4_1+linear_q5_0"  # mixed: each on its own
    a, b = logits(plain), logits(kept)  # the same weights; only the activations are quantized per block of 32
    assert float((a - b).abs().max() / a.abs().max()) < 0.05
    assert not any(getattr(m, "quantized", None) for m in plain.module.modules())


def test_where_the_kernels_do_not_run_auto_dequantizes_exactly(quantized_file: str, monkeypatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "available", lambda *args, **kwargs: False)  # as on a CPU without AVX2
        model = load_model(quantized_file, dtype="auto")
    assert model.dtype == torch.float32 and set(formats(model.module)) == {"float32"}
    assert torch.equal(
        model.module.model.layers[0].mlp.gate_proj.weight,
        load_model(quantized_file, dtype="float32").module.model.layers[0].mlp.gate_proj.weight,
    )


def test_auto_keeps_a_bfloat16_files_dtype_and_widens_float16(tmp_path) -> None:
    config = gguf_config(len(bpe_vocab()[0]))
    assert (
        load_model(write_gguf(tmp_path / "bf16.gguf", config, by_name({}, GGML.BF16)), "cpu", "auto").dtype
        == torch.bfloat16
    )
    assert (
        load_model(write_gguf(tmp_path / "f16.gguf", config, by_name({}, GGML.F16)), "cpu", "auto").dtype
        == torch.float32
    )


@needs_kernels
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_llama_cpp_gets_the_very_blocks_a_folder_quantized_at_load_runs(tmp_path, fmt: str) -> None:
    """The bench's export at a block format and `--quantize` make the same model: bitwise the same logits."""
    folder = random_checkpoint(tmp_path / "m", tiny_config(vocab_size=8192))
    shutil.copy(SHIPPED_TOKENIZER, folder)
    quantized = load_model(folder, quantize=fmt)
    exported = load_model(export_folder(folder, tmp_path / f"m-{fmt}.gguf", fmt), dtype="auto")
    assert (
        formats(exported.module)
        == formats(quantized.module)
        == {fmt: 14, "q8_0": 1} | ({"q8_0": 15} if fmt == "q8_0" else {})
    )
    assert torch.equal(logits(quantized), logits(exported))


def test_the_cli_quantizes_and_keeps_formats_and_refuses_what_cannot_run(pair_dirs, quantized_file, capsys) -> None:
    target, draft = map(str, pair_dirs)
    args = ["generate", "x = 1", "--max-new-tokens", "4", "--threads", "1", "--color", "never"]
    if kernels.available(torch.float32):
        assert main([*args, "--target", target, "--draft", draft, "--quantize", "q4_1", "--compare"]) == 0
        assert "identical to autoregressive: yes" in capsys.readouterr().out
        assert main([*args, "--target", quantized_file, "--method", "ngram"]) == 0
        capsys.readouterr()
    assert main([*args, "--target", target, "--quantize", "q8_0", "--dtype", "bfloat16"]) == 2
    assert "runs with float32 activations" in capsys.readouterr().err
