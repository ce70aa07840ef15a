"""The transformers adapter: any AutoModelForCausalLM as target or draft, its cache rolled back with crop()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from verispec import (
    DraftModel,
    InvalidArgumentError,
    TokenizerMismatchError,
    TransformersModel,
    generate,
    load,
    load_model,
)
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.checkpoints.tokenizer import byte_level_tokenizer, save_tokenizer

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10]
N = 32


def _save(model: transformers.PreTrainedModel, folder: Path) -> Path:
    model.eval().save_pretrained(folder)
    save_tokenizer(byte_level_tokenizer(), folder)
    return folder


def _gpt2(folder: Path, layers: int, seed: int, vocab_size: int = 257) -> Path:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=128,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )  # wide init: clear argmax margins
    return _save(transformers.GPT2LMHeadModel(config), folder)


def _llama(folder: Path, layers: int, seed: int) -> Path:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    return _save(transformers.LlamaForCausalLM(config), folder)


def _hf_greedy(folder: Path) -> list[int]:
    """transformers' own greedy decoding (the configs have no EOS, so it never stops early)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=N, min_new_tokens=N, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory) -> tuple[Path, Path]:
    return _gpt2(tmp_path_factory.mktemp("gpt2t"), 2, 0), _gpt2(tmp_path_factory.mktemp("gpt2d"), 1, 1)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> tuple[Path, Path]:
    return _llama(tmp_path_factory.mktemp("llamat"), 2, 0), _llama(tmp_path_factory.mktemp("llamad"), 1, 1)


@pytest.mark.parametrize("pair", ["gpt2_pair", "llama_pair"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_speculative_greedy_equals_transformers_generate(request, pair, k) -> None:
    target_dir, draft_dir = request.getfixturevalue(pair)
    expected = _hf_greedy(target_dir)
    target, draft = load(target_dir, "transformers"), load(draft_dir, "transformers")
    assert generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens == expected
    for drafter in (DraftModel(draft, k), DraftModel(target, k)):
        result = generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
        assert result.tokens == expected
        if drafter.model is target:  # drafting with the target itself: every proposal is accepted
            assert result.stats.accepted == result.stats.proposed


def test_auto_backend_picks_native_for_llama_and_transformers_for_gpt2(gpt2_pair, llama_pair) -> None:
    assert isinstance(load(gpt2_pair[0]), TransformersModel)
    assert not isinstance(load(llama_pair[0]), TransformersModel)


def test_adapter_logits_equal_native_runtime(llama_pair) -> None:
    native, adapted = load_model(llama_pair[0], dtype="float32"), load(llama_pair[0], "transformers")
    tokens = torch.tensor([PROMPT])
    torch.testing.assert_close(
        adapted(tokens, adapted.new_cache()), native(tokens, native.new_cache()), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("pair", ["gpt2_pair", "llama_pair"])
def test_logits_to_keep_gives_the_last_rows_both_ways(request, pair) -> None:
    folder = request.getfixturevalue(pair)[0]
    tokens = torch.tensor([PROMPT])
    for model in (load(folder, "transformers"), *([load_model(folder)] if pair == "llama_pair" else [])):
        full = model(tokens, model.new_cache())
        cache = model.new_cache()
        last = model(tokens, cache, logits_to_keep=2)
        assert last.shape == (1, 2, full.shape[-1]) and cache.length == len(PROMPT)
        torch.testing.assert_close(last, full[:, -2:], atol=1e-5, rtol=0)
        more = model(tokens, model.new_cache(), logits_to_keep=len(PROMPT) + 3)  # more than there are: all of them
        torch.testing.assert_close(more, full, atol=1e-5, rtol=0)


def test_rollback_through_crop(gpt2_pair) -> None:
    model = load(gpt2_pair[0], "transformers")
    tokens = torch.tensor([PROMPT])
    full = model(tokens, model.new_cache())
    cache = model.new_cache()
    model(torch.tensor([PROMPT[:5] + [7, 7, 7]]), cache)
    assert cache.truncate(5) == 3 and cache.length == cache.kv.get_seq_length() == 5
    torch.testing.assert_close(model(tokens[:, 5:], cache), full[:, 5:], atol=1e-5, rtol=0)


def test_native_draft_for_a_transformers_target(tmp_path, gpt2_pair) -> None:
    target = load(gpt2_pair[0], "transformers")
    draft = load_model(random_checkpoint(tmp_path, tiny_config(num_hidden_layers=1)))
    result = generate(target, PROMPT, DraftModel(draft, 3), max_new_tokens=N, ignore_eos=True)
    assert result.tokens == _hf_greedy(gpt2_pair[0])


def test_tree_masks_are_refused(gpt2_pair) -> None:
    model = load(gpt2_pair[0], "transformers")
    with pytest.raises(InvalidArgumentError, match="need the native runtime"):
        model(torch.tensor([PROMPT]), model.new_cache(), mask=torch.ones(8, 8, dtype=torch.bool))


def test_different_tokenizers_name_both_models(tmp_path, gpt2_pair) -> None:
    other = _gpt2(tmp_path / "other", 1, 2, vocab_size=258)  # room for the extra token, or loading refuses it
    tok = byte_level_tokenizer()
    tok.add_special_tokens(["<|pad|>"])
    save_tokenizer(tok, other)
    with pytest.raises(TokenizerMismatchError, match=r"draft other and target .*different tokenizers"):
        generate(load(gpt2_pair[0]), PROMPT, DraftModel(load(other), 2), max_new_tokens=4)
