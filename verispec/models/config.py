"""Model configuration: the Llama-family subset of a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verispec.errors import CheckpointError, UnsupportedArchitectureError

# model_type -> the class transformers would instantiate; all share Llama's math.
SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 512
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False  # Qwen2 always; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias only
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {self.model_type!r}; the native runtime supports {', '.join(SUPPORTED)}"
            )
        if self.model_type != "qwen2" and self.qkv_bias != self.o_bias:
            raise UnsupportedArchitectureError(f"{self.model_type} has biases on all attention projections or none")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise UnsupportedArchitectureError("qwen2 has q/k/v biases and no o_proj bias")
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings")
        for name in sizes:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"config {name} must be a positive integer, got {value!r}")
        if self.dim_per_head < 2 or self.dim_per_head % 2:
            raise CheckpointError(f"rotary embeddings need an even head dimension, got {self.dim_per_head}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // max(1, self.num_attention_heads)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config dict, refusing what the native math does not cover."""
        model_type = raw.get("model_type", "<missing>")
        arch = (raw.get("architectures") or [SUPPORTED.get(model_type, model_type)])[0]
        if model_type not in SUPPORTED or arch != SUPPORTED[model_type]:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch} (model_type {model_type!r}); "
                f"the native runtime supports {', '.join(SUPPORTED.values())}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"unsupported activation {raw['hidden_act']!r} in {arch}")
        if raw.get("mlp_bias"):
            raise UnsupportedArchitectureError(f"unsupported option mlp_bias in {arch}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedArchitectureError(f"unsupported RoPE scaling {rope_type!r} in {arch}")
        max_pos = raw.get("max_position_embeddings", 2048)
        # Sliding-window attention equals full attention while the context fits in the window.
        window = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None
        if window:
            max_pos = min(max_pos, window)
        eos = raw.get("eos_token_id")
        try:
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                max_position_embeddings=max_pos,
                head_dim=raw.get("head_dim"),
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
                qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias")),
                o_bias=model_type != "qwen2" and bool(raw.get("attention_bias")),
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                model_type=model_type,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            )
        except KeyError as missing:
            raise CheckpointError(f"config.json lacks {missing}") from None

    def to_hf(self) -> dict[str, Any]:
        """The config.json that transformers and this runtime both read."""
        raw = {k: v for k, v in asdict(self).items() if v is not None and k not in ("qkv_bias", "o_bias")}
        raw["architectures"] = [SUPPORTED[self.model_type]]
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        raw["torch_dtype"] = "float32"
        if self.model_type == "qwen2":
            raw["use_sliding_window"] = False
        else:
            raw["attention_bias"] = self.o_bias
        return raw


def read_config(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir}: no config.json (not a checkpoint folder)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable config.json ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: config.json is not a JSON object")
    return ModelConfig.from_hf(raw)
