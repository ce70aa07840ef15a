"""Tests for the numpy textbook forward pass and greedy speculative step in `verispec.reference`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from verispec import reference
from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.folder import save_checkpoint
from verispec.checkpoints.tokenizer import byte_level_tokenizer
from verispec.errors import InvalidArgumentError
from verispec.reference import (
    build_causal_mask,
    full_lm_forward,
    greedy_decode,
    init_params,
    load_params,
    speculative_decode_step,
)

PROMPT = np.array([3, 14, 15, 9, 26])
K = 4


def make_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
    )
    return ModelConfig(**(base | overrides))


CONFIGS = {
    "llama_gqa": make_config(),
    "llama_mha": make_config(num_key_value_heads=4),
    "llama_tied": make_config(tie_word_embeddings=True),
    "llama_bias_head_dim": make_config(qkv_bias=True, o_bias=True, head_dim=16),
    "qwen2": make_config(model_type="qwen2", qkv_bias=True),
    "qwen2_tied": make_config(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True, num_key_value_heads=1),
}


def random_ids(shape: tuple[int, ...], vocab: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape)


def hf_model(config: ModelConfig) -> transformers.PreTrainedModel:
    """The transformers model with the same architecture, in float64 with eager attention."""
    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        attn_implementation="eager",
    )
    if config.model_type == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs, use_sliding_window=False))
    else:
        hf_config = transformers.LlamaConfig(**kwargs, attention_bias=config.o_bias, head_dim=config.dim_per_head)
        model = transformers.LlamaForCausalLM(hf_config)
    return model.double().eval()


def use_float64_internals(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers computes RMSNorm, RoPE cos/sin and softmax in float32 even in a double model; redo them in float64.

    Same formulas as transformers' own, minus the float32 casts, so the comparison can be made at 1e-8.
    """
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = lambda x, m=module: (
                m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))
            )
        elif kind.endswith("RotaryEmbedding"):
            hd = module.inv_freq.shape[0] * 2
            theta = module.config.rope_parameters["rope_theta"]
            module.inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

            def rotary(x, position_ids, m=module):
                freqs = position_ids[..., None].double() * m.inv_freq
                emb = torch.cat((freqs, freqs), dim=-1)
                return emb.cos(), emb.sin()

            module.forward = rotary
    softmax = torch.nn.functional.softmax
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda x, dim=None, dtype=None: softmax(x, dim=dim))


# --- build_causal_mask -------------------------------------------------------------------------------------------


def test_causal_mask_is_lower_triangular_bool():
    mask = build_causal_mask(4)
    assert mask.shape == (4, 4) and mask.dtype == bool
    expected = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    np.testing.assert_array_equal(mask, np.array(expected, dtype=bool))
    assert build_causal_mask(1).tolist() == [[True]]


# --- full_lm_forward ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_shape_dtype_and_causality(name):
    config = CONFIGS[name]
    params = init_params(config, seed=1)
    ids = random_ids((1, 10))
    logits = full_lm_forward(ids, params)
    assert logits.shape == (1, 10, config.vocab_size) and logits.dtype == np.float64
    assert np.isfinite(logits).all() and logits.std() > 0.1  # a random model that is not all ~0

    changed = ids.copy()
    changed[0, 7] = (changed[0, 7] + 1) % config.vocab_size
    other = full_lm_forward(changed, params)
    np.testing.assert_allclose(other[:, :7], logits[:, :7], rtol=0, atol=1e-12)
    assert not np.allclose(other[:, 7:], logits[:, 7:])


def test_forward_batch_equals_single_rows_and_1d_is_batch_one():
    params = init_params(CONFIGS["llama_gqa"], seed=2)
    ids = random_ids((2, 9))
    batch = full_lm_forward(ids, params)
    assert batch.shape == (2, 9, 64)
    for row in range(2):
        np.testing.assert_allclose(batch[row : row + 1], full_lm_forward(ids[row : row + 1], params), atol=1e-12)
        np.testing.assert_allclose(batch[row : row + 1], full_lm_forward(list(ids[row]), params), atol=1e-12)


def test_forward_default_mask_is_causal_and_explicit_mask_is_used():
    params = init_params(make_config(num_hidden_layers=1), seed=3)  # one layer: the last row sees all either way
    ids = random_ids((1, 6))
    np.testing.assert_array_equal(full_lm_forward(ids, params), full_lm_forward(ids, params, build_causal_mask(6)))
    bidirectional = full_lm_forward(ids, params, np.ones((6, 6), dtype=bool))
    assert not np.allclose(bidirectional[:, :5], full_lm_forward(ids, params)[:, :5])
    np.testing.assert_allclose(bidirectional[:, 5], full_lm_forward(ids, params)[:, 5], atol=1e-12)


def test_init_params_deterministic_and_complete():
    config = CONFIGS["qwen2"]
    a, b, c = init_params(config, seed=5), init_params(config, seed=5), init_params(config, seed=6)
    assert a["config"] is config
    weights = [k for k in a if k != "config"]
    assert all(a[k].dtype == np.float64 for k in weights)
    assert all(np.array_equal(a[k], b[k]) for k in weights)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("float64_internals", [True, False], ids=["float64", "hf_float32_internals"])
def test_forward_matches_transformers(name, float64_internals, monkeypatch):
    config = CONFIGS[name]
    params = init_params(config, seed=7)
    model = hf_model(config)
    state = {k: torch.from_numpy(v) for k, v in params.items() if k != "config"}
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    if float64_internals:
        use_float64_internals(model, monkeypatch)
    ids = random_ids((2, 12))
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits.numpy()
    ours = full_lm_forward(ids, params)
    # transformers' float32 RMSNorm / RoPE / softmax cost ~1e-6 on logits of size ~30; a real bug costs O(1).
    atol = 1e-8 if float64_internals else 1e-4
    np.testing.assert_allclose(ours, expected, rtol=0, atol=atol)


# --- load_params -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_load_params_round_trip(tmp_path, tied):
    config = make_config(vocab_size=257, tie_word_embeddings=tied)
    params = init_params(config, seed=8)
    weights = {k: v for k, v in params.items() if k != "config"}
    save_checkpoint(tmp_path, config, weights, byte_level_tokenizer(), dtype=torch.float32)
    loaded = load_params(tmp_path)
    assert loaded["config"] == config
    assert set(loaded) == set(params)
    assert all(loaded[k].dtype == np.float64 for k in weights)
    ids = random_ids((1, 8), vocab=257)
    expected = full_lm_forward(ids, params)
    np.testing.assert_allclose(full_lm_forward(ids, loaded), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


# --- greedy_decode -----------------------------------------------------------------------------------------------


def test_greedy_decode_is_argmax_append_loop():
    params = init_params(CONFIGS["llama_gqa"], seed=9)
    out = greedy_decode(PROMPT, params, 5)
    assert out.shape == (len(PROMPT) + 5,)
    np.testing.assert_array_equal(out[: len(PROMPT)], PROMPT)
    tokens = list(PROMPT)
    for _ in range(5):
        tokens.append(int(np.argmax(full_lm_forward(np.array(tokens), params)[0, -1])))
    np.testing.assert_array_equal(out, tokens)
    np.testing.assert_array_equal(greedy_decode(PROMPT, params, 0), PROMPT)


# --- speculative_decode_step -------------------------------------------------------------------------------------


@pytest.fixture
def target():
    return init_params(CONFIGS["llama_gqa"], seed=0)


@pytest.fixture
def draft():
    return init_params(CONFIGS["llama_gqa"], seed=1)


def test_rule1_draft_proposes_with_greedy_decode_for_k_steps(monkeypatch, target, draft):
    calls = []
    original = reference.greedy_decode

    def recording(token_ids, params, num_steps):
        calls.append((np.asarray(token_ids).copy(), params, num_steps))
        return original(token_ids, params, num_steps)

    monkeypatch.setattr(reference, "greedy_decode", recording)
    speculative_decode_step(PROMPT, draft, target, K)
    assert len(calls) == 1
    tokens, params, num_steps = calls[0]
    assert params is draft and num_steps == K
    np.testing.assert_array_equal(tokens, PROMPT)


def test_rule2_target_runs_once_on_whole_draft_with_causal_mask(monkeypatch, target, draft):
    target_calls = []
    original = reference.full_lm_forward

    def recording(token_ids, params, mask=None):
        if params is target:
            target_calls.append((np.asarray(token_ids).copy(), mask))
        return original(token_ids, params, mask)

    monkeypatch.setattr(reference, "full_lm_forward", recording)
    speculative_decode_step(PROMPT, draft, target, K)
    assert len(target_calls) == 1
    tokens, mask = target_calls[0]
    drafted = greedy_decode(PROMPT, draft, K)
    np.testing.assert_array_equal(tokens.reshape(-1), drafted)
    assert tokens.size == len(PROMPT) + K
    assert mask is None or np.array_equal(mask, build_causal_mask(len(PROMPT) + K))


def test_rule5_identical_draft_accepts_all_and_equals_target_greedy_without_bonus(target):
    same = init_params(CONFIGS["llama_gqa"], seed=0)
    out, accepted = speculative_decode_step(PROMPT, same, target, K)
    assert accepted == K
    np.testing.assert_array_equal(out, greedy_decode(PROMPT, target, K))
    assert len(out) == len(PROMPT) + K


def test_rule3_4_unrelated_draft_rejected_at_first_token(target):
    target_next = int(np.argmax(full_lm_forward(PROMPT, target)[0, -1]))
    draft = next(
        params
        for seed in range(1, 50)
        if greedy_decode(PROMPT, params := init_params(CONFIGS["llama_gqa"], seed=seed), 1)[-1] != target_next
    )
    out, accepted = speculative_decode_step(PROMPT, draft, target, K)
    assert accepted == 0
    np.testing.assert_array_equal(out, np.append(PROMPT, target_next))


@pytest.mark.parametrize("j", range(K))
def test_rule3_4_first_disagreement_replaced_by_target_and_rest_dropped(monkeypatch, target, draft, j):
    n = len(PROMPT)
    target_greedy = greedy_decode(PROMPT, target, K)
    proposals = target_greedy.copy()
    proposals[n + j] = (proposals[n + j] + 1) % 64  # disagree at j; the tokens after j still agree, yet are dropped
    monkeypatch.setattr(reference, "greedy_decode", lambda token_ids, params, num_steps: proposals.copy())
    out, accepted = speculative_decode_step(PROMPT, draft, target, K)
    assert accepted == j
    assert len(out) == n + j + 1
    np.testing.assert_array_equal(out, target_greedy[: n + j + 1])  # prompt + accepted + target's argmax at j


def test_empty_prompt_is_rejected(target, draft):
    with pytest.raises(InvalidArgumentError):
        speculative_decode_step([], draft, target, K)
