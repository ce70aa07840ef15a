"""A quantized twin: the target's own weights in a lower block format, as a second model that drafts for it
(self-speculation, `--method selfquant`).

The twin is a `NativeModel` of the target's architecture and tokenizer whose projections are the target's requantized
(`QuantizedWeight.of`: as llama.cpp quantizes, from float32; a projection already in the twin's format keeps its very
blocks), with some of the target's blocks left out if asked. Its embedding table and norms are the target's own
tensors, shared, not copied; its LM head is the target's requantized, or the target's very head (its module and its
packing) where it already has the twin's head format or `head` asks for it. Like any quantized model it runs on
verispec's kernels, with float32 activations: the twin of a bfloat16 target reads the bfloat16 table's
rows widened to float32 by the embedding's kernel (`kernels.gather`) and holds float32 copies of the norms only (a
vector a block). It never holds a float copy of a weight matrix: each projection is made float32 one at a time, only
while it is quantized (a block-quantized target's is dequantized from its blocks, not through `.weight`, which
would keep that float copy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from verispec import kernels
from verispec.checkpoints.blocks import BLOCK, FORMATS, QuantizedWeight, check_format
from verispec.errors import IncompatibleTargetError, InvalidArgumentError
from verispec.models.kept_layers import kept_layers, layer_indices
from verispec.models.llama import LlamaForCausalLM, RMSNorm
from verispec.models.native import NativeModel
from verispec.models.packed import pack_model
from verispec.models.precision import projections, quantize_linears
from verispec.models.protocol import CausalLM

SAME_HEAD = "target"  # `TwinFormat.head`: the target's own LM head, shared as it is


@dataclass(frozen=True)
class TwinFormat:
    """What a twin is made of: its projections' block format, its LM head's (or SAME_HEAD), the target's blocks left
    out."""

    format: str = "q4_0"
    head: str = "q8_0"
    skip: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_format(self.format)
        if self.head != SAME_HEAD and self.head not in FORMATS:
            raise InvalidArgumentError(
                f"unknown head format {self.head!r}; choose one of {', '.join(FORMATS)} or "
                f"{SAME_HEAD} (the target's own head)"
            )
        object.__setattr__(self, "skip", tuple(layer_indices(self.skip)))

    @property
    def label(self) -> str:
        """How a twin's name describes it: "q4_0, head q8_0, without layers 2,5"."""
        head = "the target's head" if self.head == SAME_HEAD else f"head {self.head}"
        skipped = f", without layers {','.join(map(str, self.skip))}" if self.skip else ""
        return f"{self.format}, {head}{skipped}"


def twin_refusal(target: CausalLM) -> str | None:
    """Why no quantized twin of `target` can be made and run here, now; None where one can."""
    if not target.capabilities.twins:
        return f"a quantized twin is made of a native model's weights; {target.name} is loaded through another runtime"
    if target.dtype not in (torch.float32, torch.bfloat16) or target.device.type != "cpu":
        return (
            f"a quantized twin runs on verispec's CPU kernels with float32 activations, beside a float32 or "
            f"bfloat16 target on the CPU; {target.name} is {target.dtype} on {target.device}"
        )
    if not kernels.available(torch.float32):
        return f"a quantized twin runs on verispec's kernels, which do not run here: {kernels.reason()}"
    return None


def quantized_twin(target: NativeModel, spec: TwinFormat = TwinFormat()) -> NativeModel:
    """The twin of `target` that `spec` describes (see the module doc); an `IncompatibleTargetError` for a target it
    cannot be made of or run beside (`twin_refusal`)."""
    refusal = twin_refusal(target)
    if refusal is not None:
        raise IncompatibleTargetError(refusal)
    source = target.module
    kept = kept_layers(list(spec.skip), target)
    originals = projections(source)
    narrow = [name for name, linear in originals.items() if linear.in_features % BLOCK]
    if narrow:
        raise IncompatibleTargetError(
            f"a {spec.format} twin quantizes rows of a multiple of {BLOCK} inputs; "
            f"{target.name}'s {narrow[0]} has {originals[narrow[0]].in_features}"
        )
    shared_head = _shares_head(source, spec.head, target)
    with torch.device("meta"):
        twin = LlamaForCausalLM(replace(source.config, num_hidden_layers=len(kept)))
    twin.model.embed_tokens = source.model.embed_tokens
    twin.model.norm.weight = _float32(source.model.norm.weight)
    for mine, theirs in zip(twin.model.layers, (source.model.layers[i] for i in kept)):
        for name, norm in mine.named_modules():  # its RMSNorms
            if isinstance(norm, RMSNorm):
                norm.weight = _float32(theirs.get_submodule(name).weight)
    weights = {}
    for name, mine in projections(twin).items():
        if name != "lm_head":  # the twin's model.layers.j.* is the target's model.layers.kept[j].*
            _, _, j, rest = name.split(".", 3)
            theirs = originals[f"model.layers.{kept[int(j)]}.{rest}"]
            mine.bias = theirs.bias
            weights[name] = _requantized(theirs, spec.format)
    if shared_head:
        twin.lm_head = source.lm_head
    else:
        weights["lm_head"] = _requantized(source.lm_head, spec.head)
    quantize_linears(twin, weights)
    twin.eval()
    head = getattr(source, "head", None) if shared_head else None  # (a packed target's: models/packed.py)
    return NativeModel(
        pack_model(twin, 1, head=head), target.tokenizer, target.eos_token_ids, f"{target.name} (twin: {spec.label})"
    )


def _shares_head(source: LlamaForCausalLM, head: str, target: NativeModel) -> bool:
    """Whether the twin takes the target's LM head as it is: asked to (SAME_HEAD), or already in the format asked."""
    theirs = getattr(source.lm_head, "quantized", None)
    if head != SAME_HEAD:
        return theirs is not None and theirs.format == head
    if target.dtype != torch.float32:
        raise IncompatibleTargetError(
            f"the twin of {target.name} runs in float32, so it cannot share that "
            f"{target.dtype} target's LM head: give the head a block format"
        )
    return True


def _requantized(linear: nn.Module, format: str) -> QuantizedWeight:
    """A target's linear in `format`: its own blocks where it has them in that format, else quantized from its float
    weight (a quantized linear's dequantized for the moment, not through `.weight`, which would keep it)."""
    blocks = getattr(linear, "quantized", None)
    if blocks is not None and blocks.format == format:
        return blocks
    return QuantizedWeight.of(linear.weight if blocks is None else blocks.dequantize(), format)


def _float32(weight: nn.Parameter) -> nn.Parameter:
    """A norm's weight as the twin's float32 activations take it: the target's own, or a float32 copy of it."""
    if weight.dtype == torch.float32:
        return weight
    return nn.Parameter(weight.detach().float(), requires_grad=False)
