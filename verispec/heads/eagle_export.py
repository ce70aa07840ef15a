"""An EAGLE head's folder as each serving engine loads it (`verispec export eagle --for vllm|sglang OUT`).

vLLM and SGLang read the same one-layer Llama (`fc`, `layers.0.*` without an input norm, the target's embedding and
LM head), but one folder cannot serve both: vLLM's `EagleLlamaForCausalLM` has an fc without a bias and fails on an
`fc.bias` it has no parameter for, while SGLang's `LlamaForCausalLMEagle` has an fc with one and, reading weights
non-strictly, leaves a missing bias random. The `architectures` each maps differ too. Each export holds one weights
file at its top level (engines read every top-level `*.safetensors` as weights), verispec's extras in `verispec/`,
and for SGLang the token map of a reduced draft vocabulary (`--speculative-token-map`).

An EAGLE-3 head's folder is what both engines load as it is (the same names, `LlamaForCausalLMEagle3`, its draft
vocabulary inside as `d2t`): its export is a copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from verispec.checkpoints.draft_vocab import VOCAB_FILE, default_size, load_draft_vocab, vocab_file
from verispec.checkpoints.folder import read_head
from verispec.errors import InvalidArgumentError
from verispec.heads.eagle import without_zero_bias
from verispec.heads.eagle3 import is_eagle3

# The class each engine's registry maps a head's `architectures` to
ARCHITECTURES = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
TOKEN_MAP_DIR = "token_map"


def export_eagle(head_dir: str | Path, out: str | Path, engine: str, draft_vocab: int | None = None) -> Path:
    """`out` as `engine` ("vllm" or "sglang") loads it, from a head saved by `save_head`; the weights keep their
    bits. For SGLang, `draft_vocab` tokens (default: the head's own choice; 0: none) become its token map."""
    if engine not in ARCHITECTURES:
        raise InvalidArgumentError(f"no EAGLE export for {engine!r}; choose one of {', '.join(ARCHITECTURES)}")
    head_dir, out = Path(head_dir), Path(out)
    if is_eagle3(head_dir):
        return _export_eagle3(head_dir, out, draft_vocab)
    config, weights = read_head(head_dir, "an EAGLE head")
    weights = without_zero_bias(weights, head_dir)
    if engine == "sglang":
        weights["fc.bias"] = torch.zeros(weights["fc.weight"].shape[0], dtype=weights["fc.weight"].dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config | {"architectures": [ARCHITECTURES[engine]]}, indent=2) + "\n")
    if vocab_file(head_dir).is_file():  # so that verispec reads the export back as it read the head
        (out / VOCAB_FILE).parent.mkdir(exist_ok=True)
        shutil.copyfile(vocab_file(head_dir), out / VOCAB_FILE)
    size = default_size(head_dir) if draft_vocab is None else draft_vocab
    if engine == "sglang" and size:
        token_map(load_draft_vocab(head_dir, size), out)
    return out


def token_map(ids: torch.Tensor, out: Path) -> Path:
    """SGLang's FR-Spec token map: a torch-saved 1-D tensor of target token ids, which its EAGLE worker reads with
    `torch.load(weights_only=True)`; the draft LM head becomes the target's rows at those ids, and a draft's index i
    stands for token ids[i]."""
    file = out / TOKEN_MAP_DIR / f"freq_{len(ids)}.pt"
    file.parent.mkdir(exist_ok=True)
    torch.save(ids.to(torch.int64).contiguous(), file)
    return file


def _export_eagle3(head_dir: Path, out: Path, draft_vocab: int | None) -> Path:
    """An EAGLE-3 head's folder, copied: vLLM's `eagle3` method and SGLang's `EAGLE3` read the same files."""
    if draft_vocab is not None:
        raise InvalidArgumentError("an EAGLE-3 head carries its own draft vocabulary (d2t); it takes no --draft-vocab")
    read_head(head_dir, "an EAGLE-3 head")  # refused here, not by the engine, if unreadable
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(head_dir / name, out / name)
    return out
