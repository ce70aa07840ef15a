"""Gemma 3 GGUF files on the native runtime: tiny random files in llama.cpp's layout (its norms' scales stored whole,
a SentencePiece vocabulary without a space prefix, sliding-window layers but every sixth) held against transformers'
Gemma3ForCausalLM on the same weights; on verispec's kernels bitwise the same at any thread and row count; a
position's logits the same however it is decoded, on either kernels; every training-free method's greedy output the
plain decoding's."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from gguf_files import by_name, gguf_config, spm_vocab, write_gguf
from test_exact import PARENTS, paths, tree
from test_gguf import _transformers
from test_pool import METHODS, assert_all_equal, at_each_count
from verispec import generate, kernels
from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.gguf_checkpoint import read_gguf
from verispec.errors import CheckpointError, UnsupportedArchitectureError
from verispec.models.captured import CapturedForward
from verispec.models.native import EXACT_ROWS, NativeModel, load_model
from verispec.models.packed import packing

WINDOW = 5
LAYERS = 7  # sliding but layer 5 (every sixth global, as llama.cpp and transformers default to)
SEQ = torch.randint(0, 600, (1, 30), generator=torch.Generator().manual_seed(0))
PREFIX = 8
TEXT = "the quick brown fox jumps over the lazy dog while the other dogs sleep"
needs_kernels = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine (the thread-count test takes every count)."""


def gemma_config(**overrides) -> ModelConfig:
    """A small Gemma 3 in the file's terms: heads of 256 (transformers' default query_pre_attn_scalar, llama.cpp's
    head dimension), a window of WINDOW keys, its global layers at a RoPE base of 1e6 and the others at 1e4."""
    base = dict(
        model_type="gemma3",
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=WINDOW,
        sliding_layers=tuple(i for i in range(LAYERS) if i % 6 < 5),
        local_rope_theta=10000.0,
        query_pre_attn_scalar=256.0,
        embedding_scale=16.0,
        qk_norm=True,
        sandwich_norms=True,
        hidden_act="gelu_pytorch_tanh",
    )
    return gguf_config(len(spm_vocab()[0]), **(base | overrides))


FLOATS = by_name({}, GGML.F32)


def write_gemma(path: Path, types=FLOATS, **overrides) -> Path:
    """A Gemma 3 file as llama.cpp's converter writes it: SentencePiece without the space prefix, no chat template."""
    return write_gguf(
        path,
        gemma_config(**overrides),
        types,
        tokenizer="llama",
        template=None,
        extra=lambda writer: writer.add_add_space_prefix(False),
    )


@pytest.fixture(scope="module")
def float_file(tmp_path_factory) -> Path:
    return write_gemma(tmp_path_factory.mktemp("gemma") / "model.gguf")


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory) -> Path:
    """Q4_K_M's mix: Q5_0 q, k, gate and up, Q8_0 v and the embedding (the tied head), Q4_K o, Q6_K down."""
    types = by_name(
        {"v_proj": GGML.Q8_0, "o_proj": GGML.Q4_K, "down": GGML.Q6_K, "embed": GGML.Q8_0},
        GGML.Q5_0,
    )
    return write_gemma(tmp_path_factory.mktemp("gemma-q") / "model.gguf", types)


def test_the_config_is_read_as_llama_cpp_reads_it(float_file: Path) -> None:
    config = read_gguf(float_file).config
    assert config == gemma_config(bos_token_id=1, eos_token_id=2, rms_norm_eps=config.rms_norm_eps)
    assert [config.window(i) for i in range(LAYERS)] == [WINDOW] * 5 + [None, WINDOW]
    assert config.rope(4) == (10000.0, None) and config.rope(5) == (1e6, None)


def test_gemma3_runs_as_transformers_runs_it(float_file: Path) -> None:
    ours, (theirs, tokenizer) = load_model(float_file), _transformers(float_file)
    assert theirs.config.layer_types[5] == "full_attention" and theirs.config.query_pre_attn_scalar == 256
    for text in (TEXT, "Hello, world!", "a\nb\n\nc  d   e", "über naïve café"):
        assert ours.tokenizer.encode(text).ids == tokenizer(text)["input_ids"], text
    prompt = ours.tokenizer.encode(TEXT).ids
    assert len(prompt) > 2 * WINDOW  # the windows cut
    tokens = torch.tensor([prompt])
    with torch.inference_mode():
        expected = theirs(tokens).logits
    tolerance = 1e-5 * expected.abs().max().item()
    on_pytorch = load_model(float_file, fast=False)(tokens, None)
    assert torch.allclose(on_pytorch, expected, atol=tolerance, rtol=0)
    assert torch.allclose(ours(tokens, ours.new_cache()), expected, atol=tolerance, rtol=0)
    with torch.inference_mode():
        greedy = theirs.generate(
            tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=16, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert generate(ours, prompt, max_new_tokens=16, ignore_eos=True).tokens == greedy


def test_a_linear_rope_scaling_divides_the_global_layers_frequencies(tmp_path: Path) -> None:
    """Gemma 3 4B and larger: rope.scaling.type linear, as transformers' linear rope_type on the full-attention layers
    (its GGUF loader leaves the scaling out: the same weights in a model built with it)."""
    from transformers import Gemma3ForCausalLM

    def scaled(writer) -> None:
        writer.add_add_space_prefix(False)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)

    path = write_gguf(tmp_path / "m.gguf", gemma_config(), FLOATS, tokenizer="llama", template=None, extra=scaled)
    ours, (plain, _) = load_model(path), _transformers(path)
    assert ours.config.rope(5) == (1e6, (8.0,) * 128) and ours.config.rope(4) == (10000.0, None)
    config = copy.deepcopy(plain.config)
    config.rope_parameters["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    theirs = Gemma3ForCausalLM(config).eval()
    theirs.load_state_dict(plain.state_dict(), strict=True)
    tokens = torch.tensor([ours.tokenizer.encode(TEXT).ids])
    with torch.inference_mode():
        expected, unscaled = theirs(tokens).logits, plain(tokens).logits
    tolerance = 1e-5 * expected.abs().max().item()
    assert (unscaled - expected).abs().max() > 100 * tolerance  # the scaling matters here
    for logits in (ours(tokens, ours.new_cache()), load_model(path, fast=False)(tokens, None)):
        assert torch.allclose(logits, expected, atol=tolerance, rtol=0)


@needs_kernels
def test_the_files_own_blocks_decode_as_its_floats_do(quantized_file: Path) -> None:
    kept, plain = load_model(quantized_file, dtype="auto"), load_model(quantized_file)
    assert packing(kept.module).kernels and kept.module.lm_head.quantized.format == "q8_0"
    prompt = plain.tokenizer.encode(TEXT).ids
    a, b = (m(torch.tensor([prompt]), m.new_cache()) for m in (plain, kept))
    assert float((a - b).abs().max() / a.abs().max()) < 0.05


@needs_kernels
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_logits_are_the_same_bits_at_any_thread_count_and_row_count(quantized_file: Path, dtype: str) -> None:
    """Prefills of 1 to 12 rows (past the window), and single tokens after them (captured replays included)."""
    model = load_model(quantized_file, dtype=dtype)

    def compute() -> list[torch.Tensor]:
        out = []
        for rows in range(1, 13):
            cache = model.new_cache()
            out.append(model(SEQ[:, :rows], cache)[0])
            for i in range(rows, rows + 3):
                out.append(model(SEQ[:, i : i + 1], cache)[0])
        return out

    with torch.inference_mode():
        results = at_each_count(compute)
    assert_all_equal(results)
    # nothing but kernels: each shape's forward captured and replayed (models/captured.py)
    assert model.execution.captured and all(
        isinstance(capture, CapturedForward) for capture in model.execution.captured.values()
    )
    alone = results[1][-3]  # 12 tokens, then the 13th alone: its row equals the 13-row prefill's last
    assert torch.equal(model(SEQ[:, :13], model.new_cache())[0, -1], alone[0])


def exact_model(path: Path, own_kernels: bool) -> NativeModel:
    model = load_model(path, dtype="auto" if own_kernels else "float32", exact=True, fast=own_kernels)
    if not own_kernels:
        model.pack(EXACT_ROWS, own_kernels=False)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["own-kernels", "torch-kernels"])
def exact(request: pytest.FixtureRequest, quantized_file: Path) -> NativeModel:
    if request.param and not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run here: {kernels.reason()}")
    return exact_model(quantized_file, request.param)


def alone(model: NativeModel, tokens: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache()
    return torch.cat([model(tokens[:, i : i + 1], cache)[0] for i in range(tokens.shape[1])])


def test_every_row_of_a_prefill_and_a_chain_equals_the_position_alone(exact: NativeModel) -> None:
    plain = alone(exact, SEQ)
    assert torch.equal(exact(SEQ, exact.new_cache())[0], plain)  # in chunks on PyTorch's (EXACT_ROWS rows)
    cache = exact.new_cache()
    exact(SEQ[:, :PREFIX], cache)
    assert torch.equal(exact(SEQ[:, PREFIX : PREFIX + 7], cache)[0], plain[PREFIX : PREFIX + 7])


def test_every_node_of_a_tree_equals_its_path_decoded_alone(exact: NativeModel) -> None:
    """A tree's nodes sit in slots past their positions; the window still covers each node's own last positions."""
    tokens = torch.tensor([[int(SEQ[0, PREFIX]), 70, 71, 80, 81, 90, 82, 83]])
    mask, depths = tree(PARENTS)
    cache = exact.new_cache()
    exact(SEQ[:, :PREFIX], cache)
    logits = exact(tokens, cache, mask, depths + PREFIX)[0]
    for node, path in enumerate(paths(PARENTS)):
        plain = alone(exact, torch.cat((SEQ[:, :PREFIX], tokens[:, path]), dim=1))
        assert torch.equal(logits[node], plain[-1]), f"node {node}"


# The training-free methods (selfquant's twin runs on verispec's kernels only)
FREE = [m for m in METHODS if not m.startswith("draft") and (m != "selfquant" or kernels.available(torch.float32))]


@pytest.mark.parametrize("method", FREE)
def test_every_training_free_method_decodes_what_plain_decoding_does(exact: NativeModel, method: str) -> None:
    prompt = exact.tokenizer.encode(TEXT + " and the quick brown fox").ids
    plain = generate(exact, prompt, max_new_tokens=24, ignore_eos=True).tokens
    drafter = METHODS[method](None, exact)
    assert generate(exact, prompt, drafter, max_new_tokens=24, ignore_eos=True).tokens == plain


@needs_kernels
def test_a_batched_forward_gives_each_sequence_its_bits_alone(quantized_file: Path) -> None:
    model = load_model(quantized_file, dtype="auto")
    first, second = SEQ[:, :11], SEQ[:, 11:18]
    cache = model.new_batch_cache(2, exact=True)
    padded = torch.zeros(2, 11, dtype=torch.long)
    padded[0], padded[1, :7] = first[0], second[0]
    out = model.forward_batch(padded, cache, [0, 1], [11, 7])
    assert torch.equal(out[0], model(first, model.new_cache())[0])
    assert torch.equal(out[1, :7], model(second, model.new_cache())[0])


def test_pytorchs_attention_windows_a_cache_and_a_padded_batch_alike(float_file: Path) -> None:
    """On PyTorch's kernels (no exact mode): a whole sequence's causal mask, one token at a time over a cache, and a
    padded batch over `BatchKVCache` (each row at its own offset) cut the same windows."""
    model = load_model(float_file, fast=False)
    whole = model(SEQ[:, :20], None)[0]
    tolerance = 1e-5 * whole.abs().max().item()
    assert torch.allclose(alone(model, SEQ[:, :20]), whole, atol=tolerance, rtol=0)
    cache = model.new_batch_cache(2, exact=False)
    padded = torch.zeros(2, 20, dtype=torch.long)
    padded[0], padded[1, :9] = SEQ[0, :20], SEQ[0, 20:29]
    model.forward_batch(padded[:, :4], cache, [0, 1], [4, 4])  # then each row on from its own length
    out = model.forward_batch(padded[:, 4:], cache, [0, 1], [16, 5])
    assert torch.allclose(out[0], whole[4:], atol=tolerance, rtol=0)
    assert torch.allclose(out[1, :5], model(SEQ[:, 20:29], None)[0, 4:], atol=tolerance, rtol=0)


def test_what_the_native_runtime_lacks_is_refused(tmp_path: Path, float_file: Path) -> None:
    capped = write_gguf(
        tmp_path / "capped.gguf",
        gemma_config(num_hidden_layers=1, sliding_layers=()),
        FLOATS,
        tokenizer="llama",
        template=None,
        extra=lambda writer: writer.add_final_logit_softcapping(30.0),
    )
    with pytest.raises(UnsupportedArchitectureError, match="soft-capping"):
        load_model(capped)
    with pytest.raises(UnsupportedArchitectureError, match="GGUF files only"):
        read_gguf(float_file).config.to_hf()
    folder = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 8}
    with pytest.raises(UnsupportedArchitectureError, match="gemma3 GGUF files"):
        ModelConfig.from_hf(folder)
    with pytest.raises(CheckpointError, match="positive window"):
        gemma_config(sliding_window=None)
