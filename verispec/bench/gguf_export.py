"""A Llama checkpoint folder written as a GGUF file, so that llama.cpp runs the very weights and tokenizer we run.

llama.cpp's own converter (convert_hf_to_gguf.py) lives only in its source tree, and it rejects a byte-level BPE
tokenizer it has not seen before (it identifies pre-tokenizers by hashing a known model's output). This writer covers
what the benchmark needs, Llama checkpoints with a GPT-2-style byte-level BPE tokenizer (and RoPE unscaled or scaled as
Llama 3.1's), and names the pre-tokenizer ("gpt-2": the same split regex) from the tokenizer's own description
instead. The format is the `gguf` package's.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from verispec.checkpoints.blocks import FORMATS
from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.folder import weight_files
from verispec.checkpoints.gguf_checkpoint import ROPE_FREQS, llama_cpp_rows
from verispec.errors import CheckpointError, UnsupportedArchitectureError
from verispec.models.precision import HEAD_FORMAT

GGUF_DTYPES = ("float32", "bfloat16", "float16", *FORMATS)  # llama.cpp has no float64 weights
TYPES = {
    "float32": gguf.GGMLQuantizationType.F32,
    "bfloat16": gguf.GGMLQuantizationType.BF16,
    "float16": gguf.GGMLQuantizationType.F16,
    **FORMATS,
}
FILE_TYPES = {
    "float32": gguf.LlamaFileType.ALL_F32,
    "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
    "float16": gguf.LlamaFileType.MOSTLY_F16,
    **{name: gguf.LlamaFileType[f"MOSTLY_{name.upper()}"] for name in FORMATS},
}
GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}  # GPT-2's split regex, no prefix space


def write_gguf(checkpoint: Path, out: Path, dtype: str = "float32") -> Path:
    """Write `checkpoint` (a Llama folder: config.json, model.safetensors, tokenizer.json) to `out` with its matrices
    in `dtype` and its norms in float32, as llama.cpp's converter does. Returns `out`. A block format (one of
    quant.FORMATS) writes the blocks verispec's `load_model(quantize=)` holds: the projections in it, the LM head in
    Q8_0 (precision.HEAD_FORMAT, as its own `output` tensor), the embedding table in float32."""
    from safetensors.torch import load_file

    if dtype not in GGUF_DTYPES:
        raise CheckpointError(f"llama.cpp takes weights in {', '.join(GGUF_DTYPES)}, not {dtype}")
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise UnsupportedArchitectureError(
            f"{checkpoint}: only Llama checkpoints are written as GGUF, not {config.get('model_type')!r}"
        )
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") not in ("default", "llama3"):
        raise UnsupportedArchitectureError(f"{checkpoint}: RoPE scaling {rope['rope_type']!r} is not written as GGUF")
    # Llama 3.1's scaling: its factors, computed as llama.cpp's converter computes the rope_freqs.weight it writes
    factors = ModelConfig.from_hf(config).rope_factors if rope.get("rope_type") == "llama3" else None
    files = weight_files(checkpoint)
    missing = [file for file in files if not file.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]}: no such weights file")
    tokens, types, merges = _vocab(checkpoint, config["vocab_size"])

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    file_type = FILE_TYPES[dtype]
    writer.add_name(checkpoint.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if isinstance(config.get(key), int):
            add(config[key])
    writer.add_add_bos_token(False)  # our tokenizer adds nothing (no post-processor: _vocab refuses one)
    writer.add_add_eos_token(False)

    if factors is not None:
        writer.add_tensor(ROPE_FREQS, np.asarray(factors, dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    blocks = dtype in FORMATS
    tensors = {name: tensor for file in files for name, tensor in load_file(file).items()}
    if blocks and "lm_head.weight" not in tensors:  # tied: the head's own Q8_0 blocks, the table in float32
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    for name, tensor in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise CheckpointError(f"{checkpoint}: tensor {name} has no GGUF name")
        qtype = TYPES[
            HEAD_FORMAT
            if blocks and name == "lm_head.weight"
            else "float32"
            if blocks and name == "model.embed_tokens.weight"
            else dtype
        ]
        data = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            data = llama_cpp_rows(data, heads)
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_rows(data, kv_heads)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _vocab(checkpoint: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Token strings, token types and merges of a GPT-2-style byte-level BPE tokenizer.json."""
    from gguf import TokenType

    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{checkpoint}: no tokenizer.json")
    spec = json.loads(path.read_text())
    model, pre = spec.get("model", {}), spec.get("pre_tokenizer") or {}
    if (
        model.get("type") != "BPE"
        or spec.get("normalizer")
        or spec.get("post_processor")
        or {k: pre.get(k) for k in GPT2_PRE} != GPT2_PRE
    ):
        raise CheckpointError(
            f"{path}: only a byte-level BPE tokenizer with GPT-2's pre-tokenizer, no normalizer and "
            "no post-processor is written as GGUF"
        )
    by_id = {i: text for text, i in model["vocab"].items()}
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id |= {i: t["content"] for i, t in added.items()}
    if max(by_id) >= vocab_size:
        raise CheckpointError(f"{path}: token id {max(by_id)} does not fit the model's {vocab_size} rows")
    tokens, types = [], []
    for i in range(vocab_size):  # rows without a token stay as unused padding, as llama.cpp's converter writes them
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(
            TokenType.UNUSED
            if i not in by_id
            else TokenType.NORMAL
            if i not in added
            else TokenType.CONTROL
            if added[i].get("special")
            else TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges
