"""EAGLE-3's draft network (Li et al. 2025): the target's low, middle and high features fused, and a head with its
own LM head over a reduced draft vocabulary.

The target's residual streams entering its blocks 2, L // 2 and L - 3 (verispec's `hidden` after blocks 1, L // 2 - 1
and L - 4: the layers vLLM and SGLang capture for EAGLE-3 by default) are concatenated and mixed by `fc` (3D -> D).
One decoder layer (`midlayer`) reads [norm(embedding of the next token); norm(feature)] (2D wide into q, k, v) with
the feature as its residual; its output before the final `norm` is the feature the next draft step reads (the head
autoregresses on its own outputs, with no regression to the target's features), and `lm_head` over `norm` of it
gives logits over the draft vocabulary: draft index i is target token i + d2t[i]. Names and shapes are those of
EAGLE-3's checkpoints (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`), which vLLM's
`Eagle3LlamaForCausalLM` and SGLang's `LlamaForCausalLMEagle3` load; the target's embedding is read, never stored.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.folder import fill_head, read_head
from verispec.errors import CheckpointError
from verispec.heads.eagle import head_layout, layer_config
from verispec.models.cache import KVCache
from verispec.models.layout import AttentionMask, rotary
from verispec.models.llama import MLP, Attention, RMSNorm

ARCHITECTURE = "LlamaForCausalLMEagle3"


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target blocks whose outputs EAGLE-3 fuses: the inputs of blocks 2, L // 2 and L - 3."""
    return 1, num_layers // 2 - 1, num_layers - 4


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose attention reads [norm(embedding); norm(feature)], the feature its residual."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, q, kv = (
            config.hidden_size,
            config.num_attention_heads * config.dim_per_head,
            config.num_key_value_heads * config.dim_per_head,
        )
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(D, config.rms_norm_eps)  # on the feature
        self.self_attn = Attention(config, 0)
        self.self_attn.q_proj = nn.Linear(2 * D, q, bias=False)  # twice as wide as a plain layer's
        self.self_attn.k_proj = nn.Linear(2 * D, kv, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * D, kv, bias=False)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.mlp = MLP(config)

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """What q, k and v read: (..., 2D)."""
        return torch.cat((self.input_layernorm(embeddings), self.hidden_norm(features)), dim=-1)

    def forward(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        layout: AttentionMask,
    ) -> torch.Tensor:
        x = self.self_attn(self.inputs(features, embeddings), cos, sin, cache, layout, residual=features)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class Eagle3Head(nn.Module):
    """`layers`: the target blocks whose outputs are fused; `draft_ids` (N,): the target token of each draft index."""

    def __init__(self, config: ModelConfig, draft_ids: torch.Tensor, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.config, self.feature_layers = config, tuple(layers)  # what it reads of the target
        D, N = config.hidden_size, len(draft_ids)
        self.fc = nn.Linear(len(self.feature_layers) * D, D, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.lm_head = nn.Linear(D, N, bias=False)
        ids = draft_ids.to(torch.int64)
        self.register_buffer("d2t", ids - torch.arange(N))  # EAGLE-3's offsets: target id = i + d2t[i]
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)

    @property
    def own_vocab(self) -> torch.Tensor:
        """(N,) the target token id of each draft index: it drafts over these through its own LM head."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def new_cache(self, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
        c = self.config
        return KVCache(1, 1, c.num_key_value_heads, max_len, c.dim_per_head, dtype, device)

    @property
    def layer(self) -> Eagle3Layer:
        return self.midlayer

    def step_inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layer's attention reads ([norm(embedding); norm(feature)]), and its residual (the feature)."""
        h = self.fuse(features)
        return self.midlayer.inputs(h, embeddings), h

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features (..., len(layers) * D) mixed into the head's (..., D); its own pass through."""
        return self.fc(features) if features.shape[-1] != self.config.hidden_size else features

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """(..., N) draft logits of predicted features."""
        return self.lm_head(self.norm(predicted))

    def forward(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted features (B, T, D) (before the final norm) from features (B, T, 3D from the target, or D from the
        head itself) and the next tokens' embeddings (B, T, D); a cache and mask as `EagleHead.forward` takes them."""
        positions, mask = head_layout(features, cache, positions, mask)
        h = self.fuse(features)
        cos, sin = rotary(
            positions, self.config.dim_per_head, self.config.rope_theta, h.dtype, self.config.rope_factors
        )
        x = self.midlayer(h, embeddings, cos, sin, cache, AttentionMask(mask, causal=cache is None and mask is None))
        if cache is not None:
            cache.advance(features.shape[1])
        return x


def save_eagle3(
    head: Eagle3Head,
    folder: str | Path,
    target_name: str,
    extra: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """The head as EAGLE-3's checkpoints lay it out: model.safetensors (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
    `t2d`) and a one-layer Llama config.json with `draft_vocab_size`; `extra` joins its `verispec` section."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {
        k: (v if not v.is_floating_point() else v.detach().to(dtype)).contiguous() for k, v in head.state_dict().items()
    }
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": [ARCHITECTURE]} | layer_config(head.config, dtype) | {"draft_vocab_size": len(head.d2t)}
    config["verispec"] = {"drafter": "eagle", "target": target_name, "feature_layers": list(head.feature_layers)} | (
        extra or {}
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def is_eagle3(folder: str | Path) -> bool:
    """Whether a head's folder holds an EAGLE-3 head (by its config's architectures)."""
    try:
        return ARCHITECTURE in json.loads((Path(folder) / "config.json").read_text()).get("architectures", [])
    except (OSError, ValueError, AttributeError):
        return False


def load_eagle3(
    folder: str | Path, target: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Eagle3Head:
    """A head saved by `save_eagle3`, checked against the target it will draft for."""
    folder = Path(folder)
    raw, weights = read_head(folder, "an EAGLE-3 head")
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    wrong = [
        f"{name} {raw.get(name)} != {getattr(target, name)}" for name in sizes if raw.get(name) != getattr(target, name)
    ]
    layers = raw.get("verispec", {}).get("feature_layers") or feature_layers(target.num_hidden_layers)
    if not all(isinstance(i, int) and 0 <= i < target.num_hidden_layers for i in layers):
        wrong.append(f"feature layers {layers} outside the target's {target.num_hidden_layers} blocks")
    if wrong:
        raise CheckpointError(f"{folder}: this EAGLE-3 head was not made for this target ({', '.join(wrong)})")
    d2t = weights.get("d2t")
    if d2t is None or d2t.dim() != 1:
        raise CheckpointError(f"{folder}: an EAGLE-3 head needs d2t, its draft tokens' offsets")
    ids = d2t.to(torch.int64) + torch.arange(len(d2t))
    if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size or len(ids.unique()) != len(ids):
        raise CheckpointError(f"{folder}: d2t maps draft tokens outside the target's vocabulary or twice")
    head = Eagle3Head(replace(target, num_hidden_layers=1), ids, layers)
    return fill_head(head, weights, folder, "an EAGLE-3 head", dtype, device)
