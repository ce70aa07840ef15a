"""The shipped default pair: on disk as promised, loadable by transformers, and equal to the native runtime."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from verispec import DraftModel, generate, load_default
from verispec.checkpoints.shipped import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.cli import main

PROMPT = "def parse_header(line):"


@pytest.fixture(scope="module")
def pair():  # float32: held to transformers' float32 logits
    return load_default(dtype="float32")


@pytest.fixture(scope="module")
def hf_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(DEFAULT_TARGET),
    )


def test_files_and_sizes() -> None:
    total = 0
    for folder in (DEFAULT_TARGET, DEFAULT_DRAFT):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
            assert (folder / name).is_file(), folder / name
        with safe_open(folder / "model.safetensors", "pt") as f:
            assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
        total += sum(p.stat().st_size for p in folder.iterdir())
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert total <= 150 * 2**20


def test_loaded_in_float32_with_one_tokenizer(pair) -> None:
    target, draft = pair
    assert target.dtype == draft.dtype == torch.float32
    assert target.tokenizer.to_str() == draft.tokenizer.to_str()


def test_transformers_loads_them_and_agrees(pair, hf_target) -> None:
    target, _ = pair
    model, tokenizer = hf_target
    ids = target.tokenizer.encode(PROMPT).ids
    assert tokenizer(PROMPT)["input_ids"] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        expected = model(x).logits
    got = target(x, target.new_cache())
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def test_64_greedy_tokens_identical_to_transformers(pair, hf_target) -> None:
    target, draft = pair
    model, _ = hf_target
    ids = target.tokenizer.encode(PROMPT).ids
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id, config.do_sample = None, 0, False  # 64 tokens, EOS or not
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=config,
            max_new_tokens=64,
        )
    theirs = out[0, len(ids) :].tolist()
    assert generate(target, PROMPT, max_new_tokens=64, ignore_eos=True).tokens == theirs
    assert generate(target, PROMPT, DraftModel(draft, 4), max_new_tokens=64, ignore_eos=True).tokens == theirs


def test_generate_needs_no_arguments(capsys) -> None:
    assert main(["generate", PROMPT, "--max-new-tokens", "12", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and "tau" in out and "accepted" in out


def test_the_shipped_eagle_head(capsys) -> None:
    """bf16 on disk in EAGLE's layout, made for the shipped target, and `--method eagle` needs no other argument."""
    head = DEFAULT_TARGET.parent / "stdlib-eagle"
    for name in ("config.json", "model.safetensors", "verispec/draft_vocab.safetensors", "README.md"):
        assert (head / name).is_file(), head / name
    with safe_open(head / "model.safetensors", "pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
        assert "fc.weight" in f.keys() and not any(key.startswith(("embed_tokens", "lm_head")) for key in f.keys())
    assert (
        main(
            [
                "generate",
                PROMPT,
                "--method",
                "eagle",
                "--max-new-tokens",
                "24",
                "--threads",
                "1",
                "--compare",
                "--color",
                "never",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "identical to autoregressive: yes" in out and "drafted" in out


def test_the_shipped_medusa_heads(capsys) -> None:
    """bf16 on disk in the Medusa reference layout, with the accuracy table that shapes the tree, and `--method
    medusa` needs no other argument."""
    heads = DEFAULT_TARGET.parent / "stdlib-medusa"
    for name in (
        "config.json",
        "model.safetensors",
        "verispec/medusa_accuracy.json",
        "verispec/draft_vocab.safetensors",
        "README.md",
    ):
        assert (heads / name).is_file(), heads / name
    with safe_open(heads / "model.safetensors", "pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
        assert {"medusa_head.0.0.linear.weight", "medusa_head.3.1.weight"} <= set(f.keys())
    assert (
        main(
            [
                "generate",
                PROMPT,
                "--method",
                "medusa",
                "--max-new-tokens",
                "24",
                "--threads",
                "1",
                "--compare",
                "--color",
                "never",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "identical to autoregressive: yes" in out and "drafted" in out
