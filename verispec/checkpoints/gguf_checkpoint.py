"""A GGUF checkpoint as the native runtime reads it: the config from the metadata, the tokenizer from
`tokenizer.ggml.*` (checkpoints/gguf_tokenizer.py), and the weights under the Hugging Face names the native model uses
(`folder.param_shapes`), Q and K rows back in Hugging Face's order.

Weights come as the file holds them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K as `QuantizedWeight`
(ggml's blocks, untouched: views of the file's memory map, checkpoints/gguf_file.py); F32, F16 and BF16 as torch
tensors of that dtype; the other block formats read here (Q2_K, Q3_K) as float32, dequantized exactly by the `gguf`
package (ggml's reference code).

Llama GGUFs (Mistral's included: llama.cpp's converter writes them as llama), Qwen2 and Gemma 3 GGUFs are read.
llama.cpp's converter reorders each head's rows of W_q and W_k for llama (its RoPE rotates adjacent pairs, Hugging
Face's the two halves of a head); Qwen2's it leaves (llama.cpp runs Qwen2 with the halves' rotation). A llama file's
`rope_freqs.weight` (Llama 3.1 and 3.2: Hugging Face's rope_type "llama3") becomes `ModelConfig.rope_factors`.
Gemma 3 as llama.cpp runs it (src/models/gemma3.cpp): its norms' weights are the scales themselves (the converter
added Gemma's 1), its layers' sliding windows and local RoPE base are llama.cpp's defaults where the file is silent,
and a linear RoPE scaling (4B and larger) divides the global layers' frequencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as GGML

from verispec.checkpoints.blocks import KEPT as KEPT_FORMATS
from verispec.checkpoints.blocks import QuantizedWeight
from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.folder import param_shapes
from verispec.checkpoints.gguf_file import GGUFFile, GGUFTensor
from verispec.checkpoints.gguf_tokenizer import GGUFVocab, read_vocab
from verispec.checkpoints.tokenizer import check_tokenizer_fits
from verispec.errors import CheckpointError, UnsupportedArchitectureError

# general.architecture = model_type
ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "gemma3": gguf.MODEL_ARCH.GEMMA3}
# llama.cpp's Gemma 3 defaults: every sixth layer global, the others sliding at a RoPE base of 10000
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0
KEPT = {ggml_type: name for name, ggml_type in KEPT_FORMATS.items()}  # stay blocks: QuantizedWeight
FLOATS = {GGML.F32: torch.float32, GGML.F16: torch.float16, GGML.BF16: torch.bfloat16}
DEQUANTIZED = (GGML.Q2_K, GGML.Q3_K)
READ = ", ".join(t.name for t in (*FLOATS, *KEPT, *DEQUANTIZED))
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's RoPE frequency factors (head_dim / 2), one for all layers

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class GGUFCheckpoint:
    """What a GGUF file holds, as the native runtime takes it."""

    config: ModelConfig
    weights: dict[str, Weight]  # by Hugging Face name; no lm_head.weight where the embedding is tied
    vocab: GGUFVocab


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read a GGUF file: config, tokenizer and weights, each checked against the others."""
    file = GGUFFile(path)
    config = gguf_config(file)
    vocab = read_vocab(file)
    check_tokenizer_fits(vocab.tokenizer.get_vocab_size(with_added_tokens=True), config.vocab_size, file.path)
    return GGUFCheckpoint(config, gguf_weights(file, config), vocab)


def gguf_config(file: GGUFFile) -> ModelConfig:
    """The `ModelConfig` the metadata describes; what the native math does not cover is refused."""
    arch = file.get("general.architecture", str, "<missing>")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{file.path}: unsupported architecture {arch!r} (general.architecture); "
            f"the native runtime reads GGUF files of {', '.join(ARCHITECTURES)}"
        )

    def key(name: str) -> str:
        return f"{arch}.{name}"

    if file.get(key("expert_count"), int, 0):
        raise UnsupportedArchitectureError(
            f"{file.path}: a mixture of experts ({key('expert_count')}), which the native runtime does not implement"
        )
    scaling = file.get(key("rope.scaling.type"), str, "none")
    if scaling != "none" and (arch, scaling) != ("gemma3", "linear"):
        raise UnsupportedArchitectureError(f"{file.path}: unsupported RoPE scaling {scaling!r}")
    hidden, heads = file.require(key("embedding_length"), int), file.require(key("attention.head_count"), int)
    head_dim = file.get(key("attention.key_length"), int, hidden // max(1, heads))
    if file.get(key("attention.value_length"), int, head_dim) != head_dim:
        raise UnsupportedArchitectureError(f"{file.path}: keys and values of different widths")
    if file.get(key("rope.dimension_count"), int, head_dim) != head_dim:
        raise UnsupportedArchitectureError(
            f"{file.path}: RoPE over part of each head ({key('rope.dimension_count')} "
            f"{file.get(key('rope.dimension_count'), int)} of {head_dim})"
        )
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise CheckpointError(f"{file.path}: no token_embd.weight (the token embedding)")
    rows = int(embedding.shape[-1])  # ggml lists a matrix's dimensions innermost first
    if file.get(key("vocab_size"), int, rows) != rows:
        raise CheckpointError(
            f"{file.path}: {key('vocab_size')} is {file.get(key('vocab_size'), int)} but the "
            f"token embedding has {rows} rows"
        )
    bias = "blk.0.attn_q.bias" in file.tensors
    eos = file.get("tokenizer.ggml.eos_token_id", int)
    factors = file.tensors.get(ROPE_FREQS)
    if factors is not None and arch != "llama":  # llama.cpp reads them for llama only (of these)
        raise UnsupportedArchitectureError(
            f"{file.path}: RoPE frequency factors ({ROPE_FREQS}) in a {arch} file, which llama.cpp does not apply to it"
        )
    if factors is not None and (factors.tensor_type not in (GGML.F32, GGML.F16) or factors.shape != (head_dim // 2,)):
        raise CheckpointError(
            f"{file.path}: {ROPE_FREQS} must be {head_dim // 2} floats (F32 or F16), one per pair "
            f"of a head's dimensions; it is {factors.tensor_type.name} of shape {factors.shape}"
        )
    rope_factors = None if factors is None else tuple(np.asarray(factors.data, dtype=np.float64).tolist())
    if scaling == "linear":  # (Gemma 3's, above) positions divided by the factor: its global layers' frequencies
        rope_factors = (float(file.require(key("rope.scaling.factor"), (float, int))),) * (head_dim // 2)
    gemma = gemma3_fields(file, key, head_dim, hidden // heads) if arch == "gemma3" else {}
    return ModelConfig(
        vocab_size=rows,
        hidden_size=hidden,
        intermediate_size=file.require(key("feed_forward_length"), int),
        num_hidden_layers=file.require(key("block_count"), int),
        num_attention_heads=heads,
        num_key_value_heads=file.get(key("attention.head_count_kv"), int, heads),
        max_position_embeddings=file.require(key("context_length"), int),
        head_dim=head_dim if head_dim != hidden // max(1, heads) else None,
        rms_norm_eps=file.require(key("attention.layer_norm_rms_epsilon"), (float, int)),
        rope_theta=file.get(key("rope.freq_base"), (float, int), 10000.0),
        qkv_bias=bias,
        o_bias=bias and "blk.0.attn_output.bias" in file.tensors,
        tie_word_embeddings="output.weight" not in file.tensors,
        model_type=arch,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id", int),
        eos_token_id=eos,
        rope_factors=rope_factors,
        **gemma,
    )


def gemma3_fields(file: GGUFFile, key: Callable[[str], str], head_dim: int, per_head: int) -> dict[str, Any]:
    """What a Gemma 3 file's config holds beside Llama's, read as llama.cpp reads it."""
    if file.get(key("final_logit_softcapping"), (float, int), 0.0):
        raise UnsupportedArchitectureError(f"{file.path}: final logit soft-capping, which the native runtime lacks")
    layers = file.require(key("block_count"), int)
    window = file.get(key("attention.sliding_window"), int, 0)
    pattern = file.get(key("attention.sliding_window_pattern"), (int, list), GEMMA3_PATTERN)
    if isinstance(pattern, list):  # a flag per layer
        if len(pattern) != layers:
            raise CheckpointError(f"{file.path}: {len(pattern)} sliding-window flags for {layers} layers")
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:  # every pattern-th layer global
        sliding = tuple(i for i in range(layers) if pattern == 0 or i % pattern < pattern - 1)
    return dict(
        sliding_window=window or None,
        sliding_layers=sliding if window else (),
        local_rope_theta=float(file.get(key("rope.freq_base_swa"), (float, int), GEMMA3_LOCAL_THETA)),
        # llama.cpp's: the head dimension, but hidden / heads for the 27B (62 layers), as Google's reference code
        query_pre_attn_scalar=float(per_head if layers == 62 else head_dim),
        embedding_scale=math.sqrt(file.require(key("embedding_length"), int)),
        qk_norm=True,
        sandwich_norms=True,
        hidden_act="gelu_pytorch_tanh",
    )


def gguf_weights(file: GGUFFile, config: ModelConfig) -> dict[str, Weight]:
    """Every weight `config` needs, by its Hugging Face name; a missing, extra, misshapen or unreadable tensor is
    refused."""
    names = gguf.get_tensor_name_map(ARCHITECTURES[config.model_type], config.num_hidden_layers)
    shapes = param_shapes(config)
    hf_name = {names.get_name(name, try_suffixes=(".weight", ".bias")): name for name in shapes}
    if None in hf_name:
        raise CheckpointError(f"{file.path}: gguf {gguf.__version__} has no GGUF names for {config.model_type}")
    unexpected = sorted(set(file.tensors) - set(hf_name) - {ROPE_FREQS})  # the factors are in the config
    if unexpected:
        raise CheckpointError(
            f"{file.path}: {len(unexpected)} tensors its config does not describe: {', '.join(unexpected[:3])}"
        )
    missing = sorted(set(hf_name) - set(file.tensors))
    if missing:
        raise CheckpointError(f"{file.path}: {len(missing)} tensors missing: {', '.join(missing[:3])}")
    weights = {}
    for gguf_name, name in hf_name.items():
        tensor = file.tensors[gguf_name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if shape != shapes[name]:
            raise CheckpointError(f"{file.path}: {gguf_name} has shape {shape}, its config says {shapes[name]}")
        weights[name] = _read(tensor, file.path)
    if config.model_type == "llama":  # undo the converter's reordering of the rotated rows
        for i in range(config.num_hidden_layers):
            for proj, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
                for part in ("weight", "bias"):
                    name = f"model.layers.{i}.self_attn.{proj}.{part}"
                    if name in weights:
                        weights[name] = _rows(weights[name], rope_rows(heads, config.dim_per_head))
    return weights


def rope_rows(heads: int, head_dim: int) -> torch.Tensor:
    """The GGUF row of each Hugging Face row of W_q or W_k: llama.cpp's converter puts row i of a head's first
    half at 2i and row i of its second half at 2i + 1."""
    return torch.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """W_q or W_k (or a bias) in the row order llama.cpp's converter writes for llama: `rope_rows` the other way."""
    permuted = np.empty_like(weight)
    permuted[rope_rows(heads, weight.shape[0] // heads).numpy()] = weight
    return permuted


def _rows(weight: Weight, index: torch.Tensor) -> Weight:
    return weight.rows(index) if isinstance(weight, QuantizedWeight) else weight[index].contiguous()


def _read(tensor: GGUFTensor, path: Path) -> Weight:
    """One tensor as the module docstring says: blocks as views of the file's map (read as they are used), the
    others copied out of it."""
    kind, data = tensor.tensor_type, tensor.data
    if kind in KEPT and data.ndim == 2:
        return QuantizedWeight(KEPT[kind], torch.from_numpy(data))
    data = np.array(data)
    if kind == GGML.BF16:  # numpy has no bfloat16: the reader hands back its bytes
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    if kind in FLOATS:
        return torch.from_numpy(data)
    if kind in DEQUANTIZED or kind in KEPT:
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, kind), dtype=np.float32))
    raise CheckpointError(
        f"{path}: tensor {tensor.name} is {kind.name}, a type verispec does not read (it reads {READ})"
    )
