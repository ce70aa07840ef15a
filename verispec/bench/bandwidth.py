"""The floor under a 1-token forward: the bytes of weights it reads, over the memory's read bandwidth."""

from __future__ import annotations

import time

import torch

from verispec.models.native import NativeModel


def read_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second read at torch's thread count (the bench's): the median time of a sum over a float32 tensor
    far larger than the caches (the same memory the weights stream from)."""
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()  # touch every page before timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / sorted(times)[len(times) // 2]


def weight_bytes(model: NativeModel) -> int:
    """Bytes of weights one forward reads: every parameter once (an LM head tied to the embeddings counted once), and
    the blocks of every quantized linear; an embedding table that is not the LM head's weight not at all, as a
    forward reads only its tokens' rows."""
    module, table = model.module, model.module.model.embed_tokens
    embedding = None if getattr(table, "quantized", None) is not None else table.weight  # (a table kept in blocks)
    head = module.lm_head
    read_whole = getattr(head, "quantized", None) is None and head.weight is embedding
    blocks = sum(
        m.quantized.nbytes for m in module.modules() if getattr(m, "quantized", None) is not None and m is not table
    )
    return blocks + sum(
        param.numel() * param.element_size()
        for param in module.parameters()  # a shared one once
        if param is not embedding or read_whole
    )
