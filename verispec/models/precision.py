"""Where a model's weights get their format: float dtypes, and the block formats verispec's kernels run.

Formats: float32 and bfloat16 weights (the dtype of the whole model), and ggml's block formats (Q8_0, Q4_0, Q4_1,
Q5_0 and Q5_1; a GGUF's Q4_K, Q5_K and Q6_K too; checkpoints/blocks.py), kept quantized linear by linear
(`QuantizedLinear`) where verispec's kernels run, with float32 activations. `quantize_linears` puts a model's
projections and LM head into a block format (`--quantize`, or a GGUF file's own tensors); models/packed.py's
`pack_model` then puts in the packed modules that run every projection and the LM head as prepacked, fused matmuls.
The parameters keep their names and values.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from verispec import kernels
from verispec.checkpoints.blocks import BLOCK, KEPT, QuantizedWeight, check_format
from verispec.errors import InvalidArgumentError
from verispec.models.quant import QuantizedEmbedding, QuantizedLinear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# The dtype every loader (`load`, `load_model`, `load_default`, `load_transformers_model`) and every command's --dtype
# takes by default: a GGUF file's own formats (`file_formats`), for a folder bfloat16 where verispec's kernels run
# (`native.auto_dtype`), else float32; float32 on transformers (its bfloat16 runs on none of those kernels).
DEFAULT_DTYPE = "auto"
EMBEDDING = "model.embed_tokens"  # the token embedding table's state-dict prefix
HEAD_FORMAT = "q8_0"  # the LM head of a model quantized at load, as llama.cpp keeps its output tensor finer


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


KV_DTYPES = ("auto", "float32", "bfloat16", "float16")  # what `load_model(kv_dtype=)` takes


def kv_dtype_of(module: nn.Module, asked: str | torch.dtype = "auto", batched: bool = False) -> torch.dtype:
    """The dtype a model's key/value caches hold (`batched`: the batched engine's): `asked`, or for "auto" float16 in
    a sequence's cache where the model keeps block-quantized weights (float32 activations, attention on verispec's
    kernels, which widen it as they read: half the bytes, as llama.cpp keeps its cache), else the activations' dtype
    (the batched engine's PyTorch attention would widen a float16 cache every layer, reading more than it saves).
    A cache holds the activations' dtype, or float16 beside float32 activations."""
    activations = module.model.norm.weight.dtype  # (a linear may be quantized)
    if asked == "auto":
        quantized = activations == torch.float32 and bool(formats(module).keys() & KEPT.keys())
        return torch.float16 if quantized and not batched else activations
    dtype = parse_dtype(asked)
    if dtype != activations and (dtype, activations) != (torch.float16, torch.float32):
        raise InvalidArgumentError(
            f"a key/value cache holds the activations' dtype ({activations})"
            f"{', or float16' if activations == torch.float32 else ''}; got {dtype}"
        )
    return dtype


def projections(module: nn.Module) -> dict[str, nn.Linear]:
    """A `LlamaForCausalLM`'s linears by their state-dict prefix (`model.layers.0.self_attn.q_proj`, `lm_head`)."""
    linears = {
        f"model.layers.{i}.{part}.{name}": getattr(getattr(block, part), name)
        for i, block in enumerate(module.model.layers)
        for part, names in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        )
        for name in names
    }
    return linears | {"lm_head": module.lm_head}


def quantize_linears(module: nn.Module, weights: Mapping[str, QuantizedWeight]) -> None:
    """Replace the linears named in `weights` (by state-dict prefix, as `projections` names them) with quantized
    linears of those blocks, their biases kept, and the embedding table where EMBEDDING is named with one kept in
    blocks. Quantized weights run on verispec's kernels only: refused where they do not run."""
    if not weights:
        return
    if not kernels.available(torch.float32):
        raise InvalidArgumentError(
            f"quantized weights run on verispec's kernels, which do not run here: {kernels.reason()}"
        )
    linears = projections(module)
    for name, weight in weights.items():
        if name == EMBEDDING:
            module.model.embed_tokens = QuantizedEmbedding(weight)
            continue
        linear = linears[name]
        if weight.shape != (linear.out_features, linear.in_features):
            raise ValueError(
                f"{name}: a {weight.format} weight of {weight.shape} for a linear of "
                f"{(linear.out_features, linear.in_features)}"
            )
        parent, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attribute, QuantizedLinear(weight, linear.bias))


def formats(module: nn.Module) -> dict[str, int]:
    """How many of a model's linears (`projections`) are in each format: a block format, or a float dtype."""
    counts: dict[str, int] = {}
    for linear in projections(module).values():
        q = getattr(linear, "quantized", None)
        name = q.format if q is not None else str(linear.weight.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + 1
    return counts


def quantized_at_load(module: nn.Module, format: str) -> dict[str, QuantizedWeight]:
    """`format` blocks for every projection of a float model, and Q8_0 for its LM head (`--quantize`)."""
    check_format(format)
    linears = projections(module)
    narrow = [name for name, linear in linears.items() if linear.in_features % BLOCK]
    if narrow:
        raise InvalidArgumentError(
            f"{format} quantizes rows of a multiple of {BLOCK} inputs; {narrow[0]} has {linears[narrow[0]].in_features}"
        )
    return {
        name: QuantizedWeight.of(linear.weight, HEAD_FORMAT if name == "lm_head" else format)
        for name, linear in linears.items()
    }


def file_formats(
    weights: dict[str, torch.Tensor | QuantizedWeight],
    dtype: str | torch.dtype,
    device: torch.device | str,
    keep: bool = True,
) -> tuple[torch.dtype, dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """A GGUF file's weights (by Hugging Face name) as the model will hold them: the activations' dtype, the float
    tensors, and the modules kept as blocks (by `projections`' names, and EMBEDDING; "lm_head" too where the file
    ties it to the embedding). `dtype="auto"` keeps the file's own formats where they run (`keep`, and verispec's
    kernels available): the tensors in `quant.KEPT`'s formats as blocks, with float32 activations; a file whose
    float matrices are all bfloat16 in bfloat16; else float32. Any other `dtype` casts every weight to it, blocks
    dequantized (exact in float32)."""
    blocks = {name: w for name, w in weights.items() if isinstance(w, QuantizedWeight)}
    keep = keep and dtype == "auto" and bool(blocks) and kernels.available(torch.float32, device)
    if dtype == "auto":
        floats = {w.dtype for name, w in weights.items() if name not in blocks and w.dim() == 2}
        dtype = torch.bfloat16 if not blocks and floats == {torch.bfloat16} else torch.float32
    dtype = parse_dtype(dtype)
    out = {name: w for name, w in weights.items() if name not in blocks}
    kept: dict[str, QuantizedWeight] = {}
    for name, w in blocks.items():
        if keep:
            kept[name.removesuffix(".weight")] = w
        else:
            out[name] = w.dequantize(dtype)
    if keep and f"{EMBEDDING}.weight" in blocks and "lm_head.weight" not in weights:  # tied: the head's blocks
        kept["lm_head"] = blocks[f"{EMBEDDING}.weight"]
    return dtype, out, kept
