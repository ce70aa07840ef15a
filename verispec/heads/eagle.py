"""EAGLE's draft network (Li et al. 2024): it autoregresses on the target's features, not on tokens alone.

At position i it reads the target's final-normed feature f_i and the embedding of the next token x_{i+1}, mixes
them with `fc`, runs one Llama decoder layer (without its input norm, as in EAGLE-1) over its own KV cache, and
predicts f_{i+1}; the target's own LM head turns a predicted feature into the draft's logits. The target's embedding
and LM head are read, never copied: the head owns only `fc` and the layer. Key names follow the EAGLE checkpoints
that serving engines load (`fc.weight`, `layers.0.*`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from verispec import kernels
from verispec.checkpoints.config import ModelConfig
from verispec.checkpoints.folder import fill_head, read_head
from verispec.errors import CheckpointError
from verispec.models.cache import KVCache
from verispec.models.captured import replay
from verispec.models.layout import AttentionMask, VisibleSlots, as_index, covering, rotary, visible_slots
from verispec.models.linear import PackedLinear, packable, packed_here
from verispec.models.llama import Block
from verispec.models.packed import pack_block, swapped
from verispec.models.protocol import FINAL


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's layer has the target's shapes; one layer."""
    return replace(target, num_hidden_layers=1)


class EagleHead(nn.Module):
    feature_layers = (FINAL,)  # what it reads of the target: the final-normed feature
    own_vocab = None  # it drafts through the target's LM head

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList([Block(config, 0)])
        self.layers[0].input_layernorm = nn.Identity()  # the target's features arrive normed already

    def new_cache(self, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
        c = self.config
        return KVCache(1, 1, c.num_key_value_heads, max_len, c.dim_per_head, dtype, device)

    @property
    def layer(self) -> Block:
        return self.layers[0]

    def step_inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layer's attention reads, and its residual: fc([embedding; feature]), both (training's view)."""
        x = self.fc(torch.cat((embeddings, features), dim=-1))
        return x, x

    def forward(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted features (B, T, D) from features f_i (B, T, D) and the next tokens' embeddings (B, T, D).

        With a cache, the T inputs follow its `length` entries (a chain, or a tree with `mask` (T, length + T) and
        `positions`); without one (training) they are a whole sequence from position 0.
        """
        T, start = features.shape[1], 0 if cache is None else cache.length
        positions, mask = head_layout(features, cache, positions, mask)
        x = self.layer_over(features, embeddings, cache, positions, mask, start)
        if cache is not None:
            cache.advance(T)
        return x

    def mixed(self, x: torch.Tensor) -> torch.Tensor:
        """fc([embedding; feature])."""
        return self.fc(x)

    def layer_over(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        start: int,
    ) -> torch.Tensor:
        """The layer over the mixed inputs, after the cache's `start` entries (its room reserved)."""
        x = self.mixed(torch.cat((embeddings, features), dim=-1))  # EAGLE's order: [embedding; feature]
        cos, sin = rotary(
            positions, self.config.dim_per_head, self.config.rope_theta, x.dtype, self.config.rope_factors
        )
        return self.layers[0](x, cos, sin, cache, AttentionMask(mask, causal=cache is None and mask is None))


class PackedEagleHead(EagleHead):
    """An EAGLE head whose fc and layer run as prepacked matmuls (`pack_head`, as `load_model` packs the target): an
    inference-only fast path. Where the layer's attention runs on verispec's kernels (`halves`), a forward of one
    sequence with a cache runs nothing but kernels, captured once per shape and replayed (models/captured.py): fc
    then runs as two matmuls, one per half of its input, the second adding the first's output as a residual, so that
    no concatenation is needed (in bfloat16 the first half's product is rounded before the sum: close to the fused
    fc, not bitwise; the target decides every token)."""

    mix: PackedLinear
    halves: tuple[kernels.Matmul, kernels.Matmul] | None  # fc as its embedding and feature halves, on the kernels
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin by position, for those forwards
    captured: dict  # those forwards captured by shape
    capture: bool  # False: those forwards run op by op

    def mixed(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)

    def layer_over(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        start: int,
    ) -> torch.Tensor:
        if cache is None or features.shape[0] != 1 or self.halves is None or not packed_here(features):
            return super().layer_over(features, embeddings, cache, positions, mask, start)
        visible = visible_slots(mask, features.shape[1], start, cache.slots, torch.uint8, features.device)
        return self._on_kernels(features, embeddings, cache, positions, VisibleSlots.of(visible))

    def _on_kernels(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor,
        rows: VisibleSlots,
    ) -> torch.Tensor:
        """The forward of one sequence on verispec's kernels, captured once per shape and replayed."""
        self.rope = covering(self.rope, cache.slots, self.config, self.fc.weight.dtype)
        positions = as_index(positions)

        def forward(f: torch.Tensor, e: torch.Tensor, p: torch.Tensor, rows: VisibleSlots) -> tuple[torch.Tensor, list]:
            x = self.halves[1](f, residual=self.halves[0](e))  # fc([e; f]) = f @ W_f.T + e @ W_e.T
            cos, sin = kernels.gather(self.rope[0], p), kernels.gather(self.rope[1], p)
            return self.layers[0](x, cos, sin, cache, rows), []

        if not self.capture:
            return forward(features, embeddings, positions, rows)[0]
        key = (features.shape[1], tuple(cache.k.shape), cache.k.dtype)
        return replay(self.captured, key, cache, forward, (features, embeddings, positions), rows)[0]


def pack_head(head: EagleHead, rows: int) -> PackedEagleHead:
    """`head` packed, to take its place (its very parameters, under the same names), laid out for `rows` rows."""
    packed = swapped(head, PackedEagleHead)
    packed.mix = PackedLinear([packed.fc], rows)
    on_kernels = pack_block(packed.layers[0], rows).attention
    packed.halves, packed.rope, packed.captured, packed.capture = None, None, {}, True
    if on_kernels:
        weight, D = packed.fc.weight.detach(), packed.config.hidden_size
        packed.halves = kernels.Matmul(weight[:, :D].contiguous()), kernels.Matmul(weight[:, D:].contiguous())
    return packed


def head_layout(
    features: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafting head's forward of T inputs after its cache's entries: room reserved for them, their positions
    (default: the next T) and mask (default: causal after the cache; none without a cache, in training)."""
    T, start = features.shape[1], 0 if cache is None else cache.length
    if cache is not None:
        cache.reserve(T)
    if positions is None:
        positions = torch.arange(start, start + T, device=features.device)
    if cache is not None and mask is None and T > 1:
        mask = torch.ones(T, start + T, dtype=torch.bool, device=features.device).tril(start)
    return positions, mask


def save_head(head: EagleHead, folder: str | Path, target_name: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The head as a Hugging Face folder in EAGLE's layout: model.safetensors (`fc.weight`, `layers.0.*`) and a
    config.json of a one-layer Llama; the target's embedding and LM head are not stored. This is what vLLM's
    `EagleLlamaForCausalLM` (model_executor/models/llama_eagle.py) loads: it prefixes `model.` to each name, takes
    `fc` without a bias, drops layer 0's input norm, and shares the target's embedding and LM head."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}, str(folder / "model.safetensors")
    )
    config = {"architectures": ["EagleLlamaForCausalLM"]} | layer_config(head.config, dtype) | {"bias": False}
    config["verispec"] = {"drafter": "eagle", "target": target_name}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def layer_config(c: ModelConfig, dtype: torch.dtype) -> dict:
    """A one-layer head's config.json as a Llama's, the part EAGLE's and EAGLE-3's layouts share."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.dim_per_head,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def without_zero_bias(weights: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """The head's weights without `fc.bias`, which SGLang's export adds as zeros (its fc has a bias, ours none);
    a bias that is not zero would change the head, so it is refused."""
    bias = weights.get("fc.bias")
    if bias is not None and bool(bias.any()):
        raise CheckpointError(f"{folder}: this EAGLE head's fc has a bias that is not zero; verispec's fc has none")
    return {name: tensor for name, tensor in weights.items() if name != "fc.bias"}


def load_head(
    folder: str | Path,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    fast: bool = True,
) -> EagleHead:
    """A head saved by `save_head`, checked against the target it will draft for; `fast`: with prepacked matmuls
    for one row where this build has them (see `load_model`)."""
    folder = Path(folder)
    raw, weights = read_head(folder, "an EAGLE head")
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    wrong = [
        f"{name} {raw.get(name)} != {getattr(target, name)}" for name in sizes if raw.get(name) != getattr(target, name)
    ]
    if wrong:
        raise CheckpointError(f"{folder}: this EAGLE head was not made for this target ({', '.join(wrong)})")
    head = fill_head(
        EagleHead(head_config(target)), without_zero_bias(weights, folder), folder, "an EAGLE head", dtype, device
    )
    return pack_head(head, 1) if fast and packable(dtype, torch.device(device)) else head
