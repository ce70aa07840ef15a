"""Model configuration: the Llama-family subset of a Hugging Face `config.json`, and what sets Gemma 3 apart from
Llama (fields whose defaults are Llama's)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verispec.errors import CheckpointError, UnsupportedArchitectureError

# model_type -> the class transformers would instantiate; all share Llama's math, Gemma 3 with the fields below
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Read from GGUF files only: a Gemma folder stores each norm's scale less one, llama.cpp's converter the scale itself
GGUF_ONLY = ("gemma3",)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's act(gate) * up: SiLU, or GELU's tanh approximation
# The fields that only Gemma 3 sets, at their defaults in every model `to_hf` writes (and left out of it)
GEMMA_FIELDS = (
    "sliding_window",
    "sliding_layers",
    "local_rope_theta",
    "query_pre_attn_scalar",
    "embedding_scale",
    "qk_norm",
    "sandwich_norms",
    "hidden_act",
)
# Llama 3.1's RoPE scaling (rope_type "llama3"): the parameters its per-frequency factors are computed from
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    # llama.cpp's rope_freqs: rotary frequency i is divided by rope_factors[i] (Llama 3.1 and 3.2); None: by nothing
    rope_factors: tuple[float, ...] | None = None
    # The config.json rope_type "llama3" parameters (LLAMA3_ROPE's keys and values) the factors come from, where they
    # come from a folder; given alone, the factors are computed from them
    rope_llama3: tuple[tuple[str, float], ...] | None = None
    # Gemma 3's differences, off by default. Sliding-window layers: each row sees its last `sliding_window` positions
    # (itself included), rotated at `local_rope_theta` (without rope_factors) where set
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its inverse square root; None: head_dim
    embedding_scale: float | None = None  # the token embeddings multiplied by it (Gemma: sqrt(hidden_size))
    qk_norm: bool = False  # an RMSNorm over each head of q and of k (q_norm, k_norm), before the rotation
    # Norms on the attention's and the MLP's outputs too (post_attention_layernorm, post_feedforward_layernorm), the
    # MLP's input norm then named pre_feedforward_layernorm; without, post_attention_layernorm is the MLP's input norm
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # one of ACTIVATIONS

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {self.model_type!r}; the native runtime supports {', '.join(SUPPORTED)}"
            )
        if self.model_type != "qwen2" and self.qkv_bias != self.o_bias:
            raise UnsupportedArchitectureError(f"{self.model_type} has biases on all attention projections or none")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise UnsupportedArchitectureError("qwen2 has q/k/v biases and no o_proj bias")
        sizes = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        )
        for name in sizes:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"config {name} must be a positive integer, got {value!r}")
        if self.dim_per_head < 2 or self.dim_per_head % 2:
            raise CheckpointError(f"rotary embeddings need an even head dimension, got {self.dim_per_head}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_llama3 is not None and self.rope_factors is None:  # frozen: set once, here
            object.__setattr__(
                self, "rope_factors", llama3_rope_factors(dict(self.rope_llama3), self.dim_per_head, self.rope_theta)
            )
        factors = self.rope_factors
        if factors is not None and len(factors) != self.dim_per_head // 2:
            raise CheckpointError(
                f"{len(factors)} RoPE frequency factors for a head of {self.dim_per_head} dimensions (one per pair)"
            )
        if factors is not None and not all(isinstance(f, float) and 0 < f < math.inf for f in factors):
            raise CheckpointError("RoPE frequency factors must be positive, finite floats")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(f"unsupported activation {self.hidden_act!r}")
        if (
            self.sliding_layers
            and not (isinstance(self.sliding_window, int) and self.sliding_window > 0)
            or not set(self.sliding_layers) <= set(range(self.num_hidden_layers))
        ):
            raise CheckpointError(
                f"sliding-window layers {list(self.sliding_layers)} of {self.num_hidden_layers} need a positive "
                f"window, not {self.sliding_window!r}"
            )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // max(1, self.num_attention_heads)

    def window(self, layer: int) -> int | None:
        """The keys a row of `layer` sees back from itself (itself included): None, all of them."""
        return self.sliding_window if layer in self.sliding_layers else None

    def rope(self, layer: int) -> tuple[float, tuple[float, ...] | None]:
        """`layer`'s RoPE: its base and frequency factors."""
        if self.local_rope_theta is not None and layer in self.sliding_layers:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_factors

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config dict, refusing what the native math does not cover."""
        model_type = raw.get("model_type", "<missing>")
        arch = (raw.get("architectures") or [SUPPORTED.get(model_type, model_type)])[0]
        if model_type not in SUPPORTED or arch != SUPPORTED[model_type] or model_type in GGUF_ONLY:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch} (model_type {model_type!r}); "
                f"the native runtime supports {', '.join(SUPPORTED[t] for t in SUPPORTED if t not in GGUF_ONLY)} "
                f"folders and {', '.join(GGUF_ONLY)} GGUF files"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"unsupported activation {raw['hidden_act']!r} in {arch}")
        if raw.get("mlp_bias"):
            raise UnsupportedArchitectureError(f"unsupported option mlp_bias in {arch}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedArchitectureError(f"unsupported RoPE scaling {rope_type!r} in {arch}")
        llama3 = None
        if rope_type == "llama3":
            missing = [key for key in LLAMA3_ROPE if not isinstance(rope.get(key), (int, float))]
            if missing:
                raise CheckpointError(f"config.json: RoPE scaling llama3 without {', '.join(missing)}")
            llama3 = tuple((key, rope[key]) for key in LLAMA3_ROPE)
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
                rope_llama3=llama3,
            )
        except KeyError as missing:
            raise CheckpointError(f"config.json lacks {missing}") from None

    def to_hf(self) -> dict[str, Any]:
        """The config.json that transformers and this runtime both read."""
        if self.model_type in GGUF_ONLY:
            raise UnsupportedArchitectureError(f"a {self.model_type} model is read from GGUF files only")
        if self.rope_factors is not None and self.rope_llama3 is None:
            raise UnsupportedArchitectureError(
                "RoPE frequency factors read from a GGUF file (rope_freqs.weight) have "
                "no config.json form that transformers reads"
            )
        verispec_fields = ("qkv_bias", "o_bias", "rope_factors", "rope_llama3", *GEMMA_FIELDS)
        raw = {k: v for k, v in asdict(self).items() if v is not None and k not in verispec_fields}
        raw["architectures"] = [SUPPORTED[self.model_type]]
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_llama3 is not None:
            raw["rope_parameters"] |= {"rope_type": "llama3", **dict(self.rope_llama3)}
        raw["torch_dtype"] = "float32"
        if self.model_type == "qwen2":
            raw["use_sliding_window"] = False
        else:
            raw["attention_bias"] = self.o_bias
        return raw


def llama3_rope_factors(rope: dict[str, float], head_dim: int, theta: float) -> tuple[float, ...]:
    """The per-frequency divisors of Llama 3.1's RoPE scaling, computed as llama.cpp's converter computes the
    rope_freqs it writes (conversion/llama.py, float32): a folder and its GGUF file then rotate alike. Dividing by
    them is transformers' `_compute_llama3_parameters` up to rounding."""
    import torch

    factor, low, high, context = (rope[key] for key in LLAMA3_ROPE)
    if not (factor > 0 and 0 < low < high and context > 0):
        raise CheckpointError(
            f"config.json: RoPE scaling llama3 needs factor > 0 and 0 < low_freq_factor < high_freq_factor, got {rope}"
        )
    factors = []
    for freq in 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:  # high frequencies: as they are
            factors.append(1.0)
        elif wavelen > context / low:  # low frequencies: scaled by the whole factor
            factors.append(factor)
        else:  # between: interpolated
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(float(f) for f in torch.tensor(factors, dtype=torch.float32).tolist())


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
