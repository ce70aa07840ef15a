"""Llama 3.x and Mistral GGUF files: Llama 3.1's RoPE frequency factors (`rope_freqs.weight`) held against
transformers' own llama3 RoPE scaling, on PyTorch's path and on verispec's kernels; Mistral 7B's SentencePiece layout
with its [INST] template against transformers' GGUF loading; Mistral Nemo's `tekken` pre-tokenizer split as
llama.cpp splits it."""

from __future__ import annotations

import copy
import re
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from gguf_files import SHIPPED_TOKENIZER, bpe_vocab, by_name, gguf_config, spm_vocab, write_gguf
from test_gguf import TEXTS, _transformers
from verispec import generate, kernels
from verispec.bench.gguf_export import write_gguf as export_folder
from verispec.checkpoints.chat_template import load_chat_template
from verispec.checkpoints.config import llama3_rope_factors
from verispec.checkpoints.gguf_file import GGUFFile
from verispec.checkpoints.gguf_tokenizer import TEKKEN, read_vocab
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.errors import CheckpointError, UnsupportedArchitectureError
from verispec.models.hf_adapter import load_transformers_model
from verispec.models.native import load_model
from verispec.models.packed import packing

# Llama 3.1's scaling over a short original context, so that a prompt's positions turn the scaled frequencies far:
# head_dim 64 at theta 5e5 gives three factors of 1, three interpolated and 26 of 8
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
THETA = 500000.0
# Mistral 7B Instruct's template (v0.1), which takes bos_token and eos_token from the tokenizer
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_MESSAGES = [
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "the dog"},
    {"role": "user", "content": "run"},
]


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine."""


def _factors(head_dim: int = 64) -> np.ndarray:
    return np.asarray(llama3_rope_factors(LLAMA3, head_dim, THETA), dtype=np.float32)


@pytest.fixture(scope="module")
def llama3_file(tmp_path_factory) -> Path:
    """A Llama 3.1-style file: rope_freqs.weight, the llama-bpe pre-tokenizer, weights in Q8_0 but a Q4_K and a
    Q6_K matrix."""
    config = gguf_config(len(bpe_vocab()[0]), rope_theta=THETA)
    types = by_name({"layers.0.mlp.gate": GGML.Q4_K, "layers.1.mlp.down": GGML.Q6_K}, GGML.Q8_0)
    return write_gguf(
        tmp_path_factory.mktemp("llama3") / "model.gguf",
        config,
        types,
        pre="llama-bpe",
        add_bos=True,
        extra=lambda writer: writer.add_tensor("rope_freqs.weight", _factors()),
    )


def _with_llama3_rope(model):
    """transformers' GGUF loader leaves rope_freqs.weight out (default RoPE): the same weights in a transformers
    model built with its own llama3 scaling, the Hugging Face form of the factors."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": THETA, **LLAMA3}
    scaled = LlamaForCausalLM(config).eval()
    scaled.load_state_dict(model.state_dict(), strict=True)
    return scaled


def _greedy(model, prompt: list[int]) -> list[int]:
    """transformers' 16 greedy tokens (an explicit mask: BOS is id 0, the pad id)."""
    tokens = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            tokens,
            attention_mask=torch.ones_like(tokens),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_llama3_rope_factors_match_transformers_llama3_scaling(llama3_file) -> None:
    ours, (plain, tokenizer) = load_model(llama3_file, dtype="float32"), _transformers(llama3_file)
    theirs = _with_llama3_rope(plain)
    assert ours.config.rope_factors == tuple(_factors().tolist())
    prompt = ours.tokenizer.encode(TEXTS[1] + TEXTS[5]).ids
    assert prompt == tokenizer(TEXTS[1] + TEXTS[5])["input_ids"] and prompt[0] == 0  # llama-bpe: BOS added
    tokens = torch.tensor([prompt])
    with torch.inference_mode():
        expected, unscaled = theirs(tokens).logits, plain(tokens).logits
    tolerance = 1e-5 * expected.abs().max().item()
    assert (unscaled - expected).abs().max() > 1000 * tolerance  # the factors matter here
    on_kernels = ours(tokens, ours.new_cache())  # rotary_table, where verispec's kernels run
    on_pytorch = load_model(llama3_file, fast=False, dtype="float32")(tokens, None)  # rotary
    for logits in (on_kernels, on_pytorch):
        assert torch.allclose(logits, expected, atol=tolerance, rtol=0)
    assert generate(ours, prompt, max_new_tokens=16, ignore_eos=True).tokens == _greedy(theirs, prompt)


@pytest.mark.skipif(not kernels.available(torch.float32), reason="verispec's kernels do not run here")
def test_llama3_rope_factors_on_the_files_own_blocks(llama3_file) -> None:
    """dtype="auto": the file's blocks on verispec's kernels (float32 activations quantized per block of 32) decode
    what the float path decodes."""
    kept, plain = load_model(llama3_file, dtype="auto"), load_model(llama3_file)
    layer = kept.module.model.layers[1]
    assert packing(kept.module).kernels and layer.self_attn.q_proj.quantized.format == "q8_0"
    assert layer.mlp.down_proj.quantized.format == "q6_k"
    prompt = plain.tokenizer.encode(TEXTS[1]).ids
    a, b = (m(torch.tensor([prompt]), m.new_cache()) for m in (plain, kept))
    assert float((a - b).abs().max() / a.abs().max()) < 0.05
    assert (
        generate(kept, prompt, max_new_tokens=16, ignore_eos=True).tokens
        == generate(plain, prompt, max_new_tokens=16, ignore_eos=True).tokens
    )


def test_a_llama3_folder_and_its_gguf_rotate_alike(tmp_path) -> None:
    """A folder with rope_type llama3 is written as GGUF with rope_freqs.weight, as llama.cpp's converter writes it:
    both load to the same factors and the same logits, bit for bit."""
    config = tiny_config(vocab_size=8192, rope_theta=THETA, rope_llama3=tuple(LLAMA3.items()))
    folder = random_checkpoint(tmp_path / "m", config)
    shutil.copy(SHIPPED_TOKENIZER, folder)  # a tokenizer with merges (llama.cpp needs them)
    ours, back = load_model(folder, dtype="float32"), load_model(export_folder(folder, tmp_path / "m.gguf"))
    assert ours.config == config and back.config.rope_factors == config.rope_factors
    tokens = torch.tensor([[5, 17, 200, 3, 99, 64, 7, 300, 11, 42, 8, 1000]])
    assert torch.equal(ours(tokens, ours.new_cache()), back(tokens, back.new_cache()))


def test_rope_factors_that_do_not_fit_are_refused(tmp_path, llama3_file) -> None:
    config = gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1)
    short = write_gguf(
        tmp_path / "s.gguf",
        config,
        by_name({}, GGML.Q8_0),
        extra=lambda writer: writer.add_tensor("rope_freqs.weight", _factors()[:8]),
    )
    with pytest.raises(CheckpointError, match=r"rope_freqs.weight must be 32 floats .* shape \(8,\)"):
        load_model(short)
    qwen2 = write_gguf(
        tmp_path / "q.gguf",
        gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1, model_type="qwen2", qkv_bias=True),
        by_name({}, GGML.Q8_0),
        pre="qwen2",
        extra=lambda writer: writer.add_tensor("rope_freqs.weight", _factors()),
    )
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs.weight.*qwen2"):
        load_model(qwen2)
    # transformers' GGUF loader would drop the factors and run another model
    with pytest.raises(CheckpointError, match="rope_freqs.weight"):
        load_transformers_model(llama3_file)


# --- Mistral -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral_file(tmp_path_factory) -> Path:
    """Mistral 7B Instruct as llama.cpp's converter writes it: llama, a SentencePiece vocabulary with byte tokens and
    [INST] / [/INST] as control tokens (v0.3's), the [INST] template (v0.1's)."""
    controls = ("[INST]", "[/INST]")
    config = gguf_config(len(spm_vocab(controls)[0]))
    return write_gguf(
        tmp_path_factory.mktemp("mistral") / "model.gguf",
        config,
        by_name({}, GGML.Q8_0),
        tokenizer="llama",
        template=MISTRAL_TEMPLATE,
        controls=controls,
    )


def test_mistral_loads_as_transformers_loads_it(mistral_file) -> None:
    ours, (theirs, tokenizer) = load_model(mistral_file, dtype="float32"), _transformers(mistral_file)
    texts = [t for t in TEXTS if not t.startswith(" ") and "<|" not in t]  # llama.cpp's space prefix: test_gguf.py
    for text in texts:
        assert ours.tokenizer.encode(text).ids == tokenizer(text)["input_ids"], text
    prompt = ours.tokenizer.encode(TEXTS[-1]).ids
    with torch.inference_mode():
        expected = theirs(torch.tensor([prompt])).logits
    logits = ours(torch.tensor([prompt]), ours.new_cache())
    assert torch.allclose(logits, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    assert generate(ours, prompt, max_new_tokens=16, ignore_eos=True).tokens == _greedy(theirs, prompt)
    rendered = load_chat_template(mistral_file).render(MISTRAL_MESSAGES)
    assert rendered == tokenizer.apply_chat_template(MISTRAL_MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s>[INST] hi there [/INST]the dog</s>[INST] run [/INST]"
    # The control tokens are matched whole, and the text after each gets llama.cpp's space prefix
    encoded = ours.tokenizer.encode(rendered, add_special_tokens=False).tokens
    assert encoded[:3] == ["<s>", "[INST]", "\u2581"] and encoded[-1] == "[/INST]" and encoded.count("</s>") == 1


# --- tekken ------------------------------------------------------------------------------------------------------

# llama.cpp's regular expressions run over a copy of the text in which each character above ASCII is one byte that
# stands for its Unicode category, \p{L} and \p{N} becoming that byte and ASCII's letters or digits
# (unicode_regex_split, src/unicode.cpp); this does the same with Python's re.
COLLAPSED = {"L": "\xd2", "N": "\xd1", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
CLASSES = {"L": "\xd2A-Za-z", "N": "\xd10-9"}
TEKKEN_TEXTS = [
    "camelCaseHTTPServer getX",
    "ÉCOLE école Éc",
    "path/to/file\n\nnext/\n",
    "x=1234 ５６",
    "naïve e\u0301 ǅungla",
    "Привет МИР мИр",
    "   spaces\t\ttabs \u00a0nbsp\u2003em",
    "a\r\nb",
    "'s 'S don't DON'T",
    "A1b2C3",
    "ß ẞ",
    "日本語カタカナ",
    "x\u0300\u0301y",
    "⅓ ² ٣",
]


def llama_cpp_split(text: str, regex: str) -> list[tuple[int, int]]:
    """The (start, end) of each piece llama.cpp's `unicode_regex_split` cuts `text` into with `regex` (one that
    names \\p{L} and \\p{N} only)."""
    collapsed = "".join(
        c if ord(c) < 128 else "\x0b" if c.isspace() else COLLAPSED.get(unicodedata.category(c)[0], "\xd0")
        for c in text
    )
    pattern, inside = "", False
    for part in re.split(r"(\\p\{[LN]\}|(?<!\\)[\[\]])", regex):
        if part in ("[", "]"):
            inside = part == "["
        if part.startswith("\\p{"):
            part = CLASSES[part[3]] if inside else f"[{CLASSES[part[3]]}]"
        pattern += part
    return [m.span() for m in re.finditer(pattern, collapsed, re.ASCII)]


def test_tekken_splits_as_llama_cpp_does(tmp_path) -> None:
    """Mistral Nemo's pre-tokenizer: llama.cpp's regular expression for LLAMA_VOCAB_PRE_TYPE_TEKKEN, whole tokens
    taken as they are (ignore_merges) and BOS added where the file does not say otherwise."""
    config = gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1)
    tokenizer = read_vocab(
        GGUFFile(write_gguf(tmp_path / "t.gguf", config, by_name({}, GGML.Q8_0), pre="tekken"))
    ).tokenizer
    for text in TEXTS + TEKKEN_TEXTS:
        spans = [span for _, span in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        assert spans == llama_cpp_split(text, TEKKEN), text
    text = "camelCaseHTTPServer x1234 a/b\n"
    assert [text[a:b] for a, b in llama_cpp_split(text, TEKKEN)] == [
        "camel",
        "Case",
        "HTTPServer",
        " x",
        "1",
        "2",
        "3",
        "4",
        " a",
        "/b",
        "\n",
    ]
    assert tokenizer.encode("hi").ids[0] == 0 and tokenizer.encode("hi", add_special_tokens=False).ids[0] != 0
    assert tokenizer.decode(tokenizer.encode("camelCase 12 über").ids, skip_special_tokens=True) == "camelCase 12 über"
