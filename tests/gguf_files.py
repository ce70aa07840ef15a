"""Tiny random GGUF files for the tests, written with `gguf.GGUFWriter` as llama.cpp's converter writes them: Q and K
rows reordered for llama, matrices in chosen ggml types, norms in F32, and a tokenizer in the metadata (byte-level
BPE from the shipped target's vocabulary, or a small SentencePiece one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import TokenType

from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.gguf_checkpoint import ARCHITECTURES, llama_cpp_rows
from verispec.checkpoints.random_init import random_weights

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "stdlib-target" / "tokenizer.json"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>"]  # beside <|endoftext|>, control tokens of the BPE vocabulary
USER_DEFINED = "<tool>"
# The formats written as random blocks (gguf cannot quantize to the K-quants or IQ4_NL): where each keeps its float16
# scales (byte offsets in a block), and a scale that keeps the blocks' values of the order of a tiny model's weights.
SCALES = {
    GGML.Q5_0: ((0,), 2e-3),
    GGML.Q5_1: ((0, 2), 2e-3),
    GGML.Q2_K: ((80, 82), 1e-2),
    GGML.Q3_K: ((108,), 2e-3),
    GGML.Q4_K: ((0, 2), 2e-4),
    GGML.Q5_K: ((0, 2), 1e-4),
    GGML.Q6_K: ((208,), 4e-5),
    GGML.IQ4_NL: ((0,), 1e-3),
}


def bpe_vocab(size: int = 1024) -> tuple[list[str], list[int], list[str]]:
    """The first `size` tokens of the shipped target's byte-level BPE (tokens, token types, merges), with two more
    control tokens and a user-defined one."""
    spec = json.loads(SHIPPED_TOKENIZER.read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)[:size]
    tokens[0] = "<|endoftext|>"
    types = [TokenType.CONTROL] + [TokenType.NORMAL] * (len(tokens) - 1)
    kept = set(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    merges = [m for m in merges if set(m.split(" ")) <= kept and m.replace(" ", "") in kept]
    tokens += [*SPECIALS, USER_DEFINED]
    types += [TokenType.CONTROL] * len(SPECIALS) + [TokenType.USER_DEFINED]
    return tokens, types, merges


def spm_vocab(controls: tuple[str, ...] = ()) -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece vocabulary: <unk>, <s>, </s>, `controls` (more control tokens, as Mistral's [INST]), the 256
    byte tokens, and pieces of a few words (with the visible space) scored by how common they are in them."""
    text = (
        "the quick brown fox jumps over the lazy dog while the other dogs sleep; then they all wake up and "
        "run together through the open field, over hills and rivers, until the evening comes"
    )
    counts: dict[str, int] = {}
    for word in text.split():
        piece = "\u2581" + word
        for i in range(len(piece)):
            for j in range(i + 1, min(len(piece), i + 6) + 1):
                counts[piece[i:j]] = counts.get(piece[i:j], 0) + 1
    pieces = sorted(counts, key=lambda p: (-counts[p] * len(p), p))
    tokens = ["<unk>", "<s>", "</s>", *controls, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [
        TokenType.UNKNOWN,
        *[TokenType.CONTROL] * (2 + len(controls)),
        *[TokenType.BYTE] * 256,
        *[TokenType.NORMAL] * len(pieces),
    ]
    scores = [0.0] * (259 + len(controls)) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def gguf_config(vocab: int, **overrides) -> ModelConfig:
    """A small grouped-query model whose rows are whole K-quant blocks (256 inputs)."""
    base = dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    return ModelConfig(**(base | overrides))


def random_blocks(shape: tuple[int, ...], qtype: GGML, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a format gguf cannot quantize to, with small float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    offsets, scale = SCALES[qtype]
    for offset in offsets:
        values = (rng.uniform(0.5, 1, rows.shape[:2]) * scale).astype(np.float16)
        rows[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return rows.reshape(shape[0], -1)


def write_gguf(
    path: Path,
    config: ModelConfig,
    types: Callable[[str], GGML],
    *,
    tokenizer: str = "gpt2",
    pre: str | None = "gpt-2",
    seed: int = 0,
    name: str = "tiny",
    add_bos: bool | None = None,
    template: str | None = CHATML,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    controls: tuple[str, ...] = (),
) -> Path:
    """Write a random model of `config` to `path`: each weight (by Hugging Face name) in `types(name)`, 1-D ones
    in F32; `tokenizer` "gpt2" (byte-level BPE, pre-tokenizer `pre`) or "llama" (SentencePiece, with `controls`)."""
    rng = np.random.default_rng(seed)
    arch = config.model_type
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.dim_per_head)
    if config.head_dim is not None:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if tokenizer == "gpt2":
        tokens, token_types, merges = bpe_vocab()
        writer.add_tokenizer_model("gpt2")
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_bos_token_id(0)
    else:
        tokens, token_types, scores = spm_vocab(controls)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.add_token_list(tokens[: config.vocab_size])
    writer.add_token_types(token_types[: config.vocab_size])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if template is not None:
        writer.add_chat_template(template)
    if extra is not None:
        extra(writer)
    names = gguf.get_tensor_name_map(ARCHITECTURES[arch], config.num_hidden_layers)
    for hf_name, weight in random_weights(config, seed).items():
        weight = weight.astype(np.float32)
        if arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
            weight = llama_cpp_rows(
                weight, config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            )
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        qtype = GGML.F32 if weight.ndim == 1 else types(hf_name)
        if qtype == GGML.F32:
            writer.add_tensor(gguf_name, weight)
        elif qtype in SCALES:
            writer.add_tensor(gguf_name, random_blocks(weight.shape, qtype, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def by_name(table: dict[str, GGML], default: GGML = GGML.F32) -> Callable[[str], GGML]:
    """`types` for `write_gguf`: the type of the first key found in a weight's name."""
    return lambda name: next((qtype for key, qtype in table.items() if key in name), default)
