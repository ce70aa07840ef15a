"""Native runtime tests: parity with the numpy reference and transformers, load errors, dtypes, shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from verispec import kernels, reference
from verispec.checkpoints.config import ModelConfig, read_config
from verispec.checkpoints.random_init import BYTE_VOCAB, TINY_SHAPES, random_checkpoint, tiny_config
from verispec.checkpoints.tokenizer import byte_level_tokenizer
from verispec.errors import CheckpointError, InvalidArgumentError, UnsupportedArchitectureError
from verispec.generate import generate
from verispec.models.native import NativeModel, load_model

TOKENS = torch.randint(0, BYTE_VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))


def logits(model: NativeModel, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """Logits (1, T, V) of one forward into a fresh cache."""
    return model(tokens.to(model.device), model.new_cache())


def reference_logits(folder: Path, tokens: torch.Tensor = TOKENS) -> np.ndarray:
    return reference.full_lm_forward(tokens.numpy(), reference.load_params(folder))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid float32 tiny Llama checkpoint, shared read-only by the tests of this module."""
    return random_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config(), seed=4)


@pytest.fixture
def broken(tiny: Path, tmp_path: Path) -> Path:
    """A private copy of `tiny` for a test to damage."""
    return Path(shutil.copytree(tiny, tmp_path / "ckpt"))


# --- parity with the numpy float64 reference ---------------------------------------------------------------------

# Llama 3.1's RoPE scaling over a short original context (head_dim 16: one frequency kept, one interpolated)
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
REFERENCE_CONFIGS = {
    "llama_gqa": tiny_config(),
    "llama_mha": tiny_config(num_key_value_heads=4),
    "llama_tied": tiny_config(tie_word_embeddings=True),
    "llama_attention_bias": tiny_config(qkv_bias=True, o_bias=True),
    "llama_head_dim": tiny_config(head_dim=24, rope_theta=500.0),  # 4 heads * 24 != hidden 64
    "qwen2": tiny_config(model_type="qwen2", qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-5),
    "llama3_rope": tiny_config(rope_theta=5e5, rope_llama3=tuple(LLAMA3_ROPE.items())),  # Llama 3.1's scaling
}


@pytest.mark.parametrize("name", REFERENCE_CONFIGS)
def test_native_float32_matches_reference(name: str, tmp_path: Path) -> None:
    config = REFERENCE_CONFIGS[name]
    folder = random_checkpoint(tmp_path, config, seed=11)
    model = load_model(folder, dtype="float32")
    assert model.config == config  # config.json round trip (to_hf, then from_hf)
    ours = logits(model)
    assert ours.dtype == torch.float32 and ours.shape == (1, TOKENS.shape[1], BYTE_VOCAB)
    np.testing.assert_allclose(ours.numpy(), reference_logits(folder), rtol=0, atol=1e-4)


# --- parity with transformers ------------------------------------------------------------------------------------

HF_COMMON = TINY_SHAPES | dict(
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    # The default initializer_range 0.02 leaves logits so flat that greedy choices are near-ties
    # (top-2 gaps ~1e-4): 0.2 gives margins of ~1e-2, far above the float32 differences.
    initializer_range=0.2,
)

HF_MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "llama_gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_COMMON)),
    "llama_bias_head_dim": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**HF_COMMON, attention_bias=True, head_dim=24)
    ),
    "llama_tied_mha": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**HF_COMMON | {"num_key_value_heads": 4}, tie_word_embeddings=True)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF_COMMON, use_sliding_window=False)),
    "mistral_gqa": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**HF_COMMON | {"num_key_value_heads": 1}, sliding_window=64)
    ),
    "llama3_rope": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**HF_COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5} | LLAMA3_ROPE)
    ),
}


def hf_checkpoint(name: str, folder: Path) -> transformers.PreTrainedModel:
    """A random float32 transformers model saved to `folder` with the byte-level tokenizer."""
    torch.manual_seed(0)
    model = HF_MODELS[name]().float().eval()
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: perturb them so they count
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    return model


@pytest.mark.parametrize("name", HF_MODELS)
def test_native_matches_transformers_logits_and_greedy_tokens(name: str, tmp_path: Path) -> None:
    hf = hf_checkpoint(name, tmp_path)
    model = load_model(tmp_path, dtype="float32")
    assert model.config.tie_word_embeddings == ("tied" in name)
    with torch.no_grad():
        expected = hf(TOKENS).logits
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-4)

    prompt = TOKENS[:, :8]
    # No EOS in the config, so neither side stops early and min_new_tokens masks nothing.
    hf_out = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=32,
        min_new_tokens=32,
        pad_token_id=0,
    )
    ours = generate(model, prompt[0].tolist(), max_new_tokens=32, ignore_eos=True)
    assert ours.stop_reason == "max_new_tokens"
    assert ours.tokens == hf_out[0, 8:].tolist()


# --- checkpoint loading errors -----------------------------------------------------------------------------------


def write_config(folder: Path, raw: dict[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(raw))


def edit_config(folder: Path, **changes: Any) -> None:
    raw = json.loads((folder / "config.json").read_text())
    write_config(folder, raw | changes)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        load_model(tmp_path / "nowhere")


def test_no_config_json(broken: Path) -> None:
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(broken)


@pytest.mark.parametrize("text", ["{not json", ""])
def test_config_json_not_json(broken: Path, text: str) -> None:
    (broken / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="unreadable config.json"):
        load_model(broken)


def test_config_json_not_an_object(broken: Path) -> None:
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        load_model(broken)


def test_config_json_lacks_a_field(broken: Path) -> None:
    raw = json.loads((broken / "config.json").read_text())
    del raw["hidden_size"]
    write_config(broken, raw)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(broken)


def test_weights_file_missing(broken: Path) -> None:
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing model.safetensors"):
        load_model(broken)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],
        lambda data: data[:20],
        lambda data: b"\x00garbage" * 64,
        lambda data: b"",
    ],
    ids=["truncated_half", "truncated_header", "garbage", "empty"],
)
def test_weights_file_corrupt(broken: Path, damage: Callable[[bytes], bytes]) -> None:
    path = broken / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        load_model(broken)


def test_weight_missing(broken: Path) -> None:
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(broken)


def test_weight_wrong_shape(broken: Path) -> None:
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(64, 64\), config says \(32, 64\)"):
        load_model(broken)


def test_no_tokenizer_json(broken: Path) -> None:
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_model(broken)


def test_gpt2_is_unsupported_architecture(broken: Path) -> None:
    write_config(
        broken,
        {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": 50257,
            "n_embd": 768,
            "n_head": 12,
            "n_layer": 12,
            "n_positions": 1024,
        },
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as err:
        load_model(broken)
    assert "gpt2" in str(err.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}},
        {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    ],
    ids=["dynamic", "legacy_linear", "legacy_yarn"],
)
def test_unsupported_rope_scaling(broken: Path, changes: dict[str, Any]) -> None:
    edit_config(broken, **changes)
    with pytest.raises(UnsupportedArchitectureError, match="unsupported RoPE scaling"):
        load_model(broken)


def test_llama3_rope_scaling_needs_its_parameters(broken: Path) -> None:
    edit_config(broken, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    with pytest.raises(CheckpointError, match="llama3 without low_freq_factor, high_freq_factor, original_max"):
        load_model(broken)
    edit_config(broken, rope_parameters=None, rope_theta=5e5, rope_scaling={"rope_type": "llama3"} | LLAMA3_ROPE)
    factors = read_config(broken).rope_factors  # transformers' older form reads the same
    assert factors == REFERENCE_CONFIGS["llama3_rope"].rope_factors and len(factors) == 8
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and set(factors[2:]) == {8.0}


def test_mlp_bias_is_unsupported(broken: Path) -> None:
    edit_config(broken, mlp_bias=True)
    with pytest.raises(UnsupportedArchitectureError, match="mlp_bias"):
        load_model(broken)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"vocab_size": "257"}, "vocab_size must be a positive integer"),
        ({"head_dim": 7}, "even head dimension"),
        ({"hidden_act": "gelu"}, "unsupported activation 'gelu'"),
    ],
)
def test_invalid_config_values(broken: Path, changes: dict[str, Any], message: str) -> None:
    raw = json.loads((broken / "config.json").read_text()) | changes
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        load_model(broken)


def test_generation_config_eos_ids_are_added(broken: Path) -> None:
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 256]}))
    assert load_model(broken).eos_token_ids == {3, 256}


@pytest.mark.parametrize("text", ["{oops", "[1, 2]"])
def test_unreadable_generation_config(broken: Path, text: str) -> None:
    (broken / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match="generation_config.json: unreadable"):
        load_model(broken)


# --- precision and device ----------------------------------------------------------------------------------------


def test_float64_load_matches_reference_closely(tiny: Path) -> None:
    model = load_model(tiny, dtype="float64")
    assert model.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in model.module.parameters())
    np.testing.assert_allclose(logits(model).numpy(), reference_logits(tiny), rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16, "float16"])
def test_low_precision_load_is_close_to_float32(tiny: Path, dtype: str | torch.dtype) -> None:
    model = load_model(tiny, dtype=dtype)
    expected_dtype = torch.float16 if dtype == "float16" else torch.bfloat16
    assert model.dtype == expected_dtype and model.new_cache().k.dtype == expected_dtype
    ours = logits(model)
    assert ours.dtype == expected_dtype
    full = logits(load_model(tiny, dtype="float32"))
    torch.testing.assert_close(ours.float(), full, rtol=0, atol=0.05 * full.abs().max().item())


def test_device_is_a_parameter(tiny: Path) -> None:
    for device in ("cpu", torch.device("cpu")):
        model = load_model(tiny, device=device)
        assert model.device == torch.device("cpu") and model.new_cache().k.device == torch.device("cpu")


@pytest.mark.parametrize(
    "device, message",
    [("nonsense", "device 'nonsense' is not usable"), ("meta", "it holds no data"), (0, "must be a string")],
)
def test_unknown_device_is_an_invalid_argument(tiny: Path, device, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        load_model(tiny, device=device)


def test_bf16_checkpoint_is_upcast_exactly_to_float32(tmp_path: Path) -> None:
    folder = random_checkpoint(tmp_path, tiny_config(), seed=5, dtype=torch.bfloat16)
    on_disk = load_file(folder / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in on_disk.values())
    model = load_model(folder, dtype="float32")
    assert model.dtype == torch.float32
    state = model.module.state_dict()
    assert all(state[n].dtype == torch.float32 and torch.equal(state[n], w.float()) for n, w in on_disk.items())
    np.testing.assert_allclose(logits(model).numpy(), reference_logits(folder), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float8", "fp32", "int8"])
def test_unknown_dtype_is_invalid_argument(tiny: Path, dtype: str) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown dtype"):
        load_model(tiny, dtype=dtype)


# --- sharded checkpoints -----------------------------------------------------------------------------------------


def shard(folder: Path) -> dict[str, str]:
    """Split model.safetensors into two shards with an index, as transformers writes them; returns the weight map."""
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(w.numel() * w.element_size() for w in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_sharded_checkpoint_loads_identically(tiny: Path, broken: Path) -> None:
    weight_map = shard(broken)
    assert len(set(weight_map.values())) == 2 and not (broken / "model.safetensors").exists()
    sharded, whole = load_model(broken), load_model(tiny)
    assert sharded.module.state_dict().keys() == whole.module.state_dict().keys()
    assert all(
        torch.equal(a, b) for a, b in zip(sharded.module.state_dict().values(), whole.module.state_dict().values())
    )
    torch.testing.assert_close(logits(sharded), logits(whole), rtol=0, atol=0)


def test_sharded_checkpoint_with_a_missing_shard(broken: Path) -> None:
    shard(broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing model-00002-of-00002.safetensors"):
        load_model(broken)


@pytest.mark.parametrize("index", ["not json", "{}", "[]", '{"weight_map": 3}'])
def test_unreadable_shard_index(broken: Path, index: str) -> None:
    shard(broken)
    (broken / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="unreadable shard index"):
        load_model(broken)


# --- Mistral's sliding window ------------------------------------------------------------------------------------

BASE_HF = TINY_SHAPES | dict(max_position_embeddings=256)


@pytest.mark.parametrize(
    "model_type, extra, context",
    [
        ("mistral", {"sliding_window": 64}, 64),  # Mistral uses its window unless told otherwise
        ("mistral", {"sliding_window": 4096}, 256),  # a window longer than the context changes nothing
        ("mistral", {"sliding_window": None}, 256),  # Mistral v0.2+: no window
        ("mistral", {"sliding_window": 64, "use_sliding_window": False}, 256),
        ("qwen2", {"sliding_window": 64, "use_sliding_window": True}, 64),
        ("qwen2", {"sliding_window": 64, "use_sliding_window": False}, 256),
        ("qwen2", {"sliding_window": 64}, 256),  # Qwen2's default is no sliding window
        ("llama", {"sliding_window": 64}, 256),  # Llama has none: the key is ignored
    ],
    ids=[
        "mistral_window",
        "mistral_long_window",
        "mistral_no_window",
        "mistral_disabled",
        "qwen2_enabled",
        "qwen2_disabled",
        "qwen2_default",
        "llama_ignored",
    ],
)
def test_sliding_window_caps_context(model_type: str, extra: dict[str, Any], context: int) -> None:
    config = ModelConfig.from_hf(BASE_HF | {"model_type": model_type} | extra)
    assert config.max_position_embeddings == context


def test_mistral_checkpoint_context_is_its_window(broken: Path) -> None:
    edit_config(broken, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=32)
    assert read_config(broken).max_position_embeddings == 32
    model = load_model(broken)
    assert model.context_length == 32 and model.new_cache().max_len == 32


def test_auto_with_quantize_runs_float32_activations(tmp_path) -> None:
    """`load_model(folder, dtype="auto", quantize=...)`: a quantized model's activations are float32, whatever auto
    would choose for the folder alone."""
    if not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    model = load_model(random_checkpoint(tmp_path / "m", tiny_config()), dtype="auto", quantize="q8_0")
    assert model.dtype == torch.float32
