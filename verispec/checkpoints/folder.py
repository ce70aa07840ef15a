"""Hugging Face-format checkpoint folders: parameter names and shapes, reading and writing weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.tokenizer import save_tokenizer
from verispec.errors import CheckpointError


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama-family checkpoint, by its Hugging Face name."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.dim_per_head
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if config.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if config.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)}
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def unreadable(path: str | Path, err: OSError) -> CheckpointError:
    """A file or folder the OS will not let us read: named as such, never as a missing or corrupt one."""
    why = "permission denied" if isinstance(err, PermissionError) else f"cannot read it ({err.strerror or err})"
    return CheckpointError(f"{path}: {why}")


def check_folder(checkpoint_dir: str | Path) -> Path:
    """The folder, after opening it and each file in it once.

    A permission problem is named here, at the entry point: further down, pathlib and safetensors report an
    unreadable file as a missing one, and a bare PermissionError would escape `Path.is_file`.
    """
    folder = Path(checkpoint_dir)
    try:
        with os.scandir(folder) as entries:
            files = [entry.path for entry in entries if entry.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{checkpoint_dir}: no such checkpoint folder") from None
    except OSError as err:
        raise unreadable(folder, err) from None
    for file in files:
        try:
            os.close(os.open(file, os.O_RDONLY))
        except OSError as err:
            raise unreadable(file, err) from None
    return folder


def check_finite(weights: Iterable[tuple[str, torch.Tensor]], source: str | Path) -> None:
    """Refuse NaN or inf in any floating-point weight: such a model generates garbage or crashes the sampler.

    Checked after any cast, since a large float32 weight overflows to inf in float16.
    """
    for name, tensor in weights:
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(
                f"{source}: weight {name} holds NaN or infinite values (in {tensor.dtype}); the checkpoint is broken"
            )


def weight_files(folder: Path) -> list[Path]:
    """The files that hold a checkpoint's weights: the shards its index names, else `model.safetensors` (other
    .safetensors files beside them, such as a draft vocabulary, are not weights)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return [folder / "model.safetensors"]
    try:
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{index}: unreadable shard index ({err!r})") from None


def load_weights(checkpoint_dir: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Read `model.safetensors` (or its shards) and check every expected weight is there with its shape."""
    folder = Path(checkpoint_dir)
    files = weight_files(folder)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{folder}: missing {file.name}")
        try:
            weights |= load_file(file)
        except OSError as err:
            raise unreadable(file, err) from None
        except (SafetensorError, ValueError) as err:
            raise CheckpointError(f"{file}: corrupt safetensors file ({err})") from None
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    expected = param_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} weights missing from checkpoint: {', '.join(missing[:3])}")
    # Extra weights mean the config describes another model (fewer layers, no biases); rotary frequencies are
    # recomputed from the config, so the buffers older exports saved are no such sign.
    unexpected = sorted(name for name in set(weights) - set(expected) if not name.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointError(
            f"{folder}: {len(unexpected)} weights the config does not describe: {', '.join(unexpected[:3])}"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(weights[name].shape)}, config says {shape}")
    return {name: weights[name] for name in expected}


def save_checkpoint(
    checkpoint_dir: str | Path,
    config: ModelConfig,
    weights: Mapping[str, np.ndarray | torch.Tensor],
    tokenizer: Tokenizer,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files: a folder transformers can load too."""
    folder = Path(checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: torch.as_tensor(v).to(dtype).contiguous() for k, v in weights.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    raw = config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_tokenizer(tokenizer, folder, config.max_position_embeddings)
    return folder


def read_head(folder: Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a drafting head's folder (`kind` names it in errors)."""
    try:
        return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"{folder}: not {kind} folder ({err})") from None


def fill_head(
    module: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    folder: Path,
    kind: str,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.nn.Module:
    """`module` with exactly `weights`, cast, frozen, and refused if any weight is not finite after the cast."""
    try:
        module.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{folder}: weights do not fit {kind} ({str(err).splitlines()[0]})") from None
    module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    check_finite(module.state_dict().items(), folder)  # after the cast, which can overflow
    return module
