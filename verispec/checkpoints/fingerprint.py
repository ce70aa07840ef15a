"""What identifies a target for the drafting heads shipped for it: a GGUF file's own metadata, never its path.

A head trained for SmolLM2-135M-Instruct should be found for any copy of that model's GGUF, wherever it lies and
whatever its file name or quantization, and for nothing else: the match is on the model's names as the converter
wrote them (general.architecture, basename, size_label, finetune), its shapes, and a hash of its vocabulary (the
token strings in order), all of which a copy in another quantization keeps.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from verispec.checkpoints.gguf_file import GGUFFile

NAMES = ("general.architecture", "general.basename", "general.size_label", "general.finetune")
SHAPES = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv")


def gguf_fingerprint(path: str | Path) -> dict[str, str | int | None]:
    """The identity of the model in a GGUF file: its names, shapes and vocabulary hash."""
    file = GGUFFile(path)
    identity: dict[str, str | int | None] = {key: file.get(key, str) for key in NAMES}
    arch = identity["general.architecture"]
    for key in SHAPES:
        identity[f"{arch}.{key}"] = file.get(f"{arch}.{key}", int)
    tokens = file.get("tokenizer.ggml.tokens", list) or []
    identity["vocab_size"] = len(tokens)
    identity["vocab_sha256"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    return identity
