"""A file memory-mapped for reading its tensors in place, as llama.cpp maps a GGUF file.

A tensor read from the map (`MappedFile.array`) costs nothing until it is used, and what is used stays resident only
while it is mapped: once a weight has been packed into the kernels' own layout (a copy), `forget_pages` hands its
pages back to the page cache, so that loading never holds the file and its packed copy at once. A page forgotten and
read again comes back from the file (the map is private and never written).
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from pathlib import Path

import numpy as np
import torch

_maps: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # every live map, for `forget_pages` to find a tensor's


class MappedFile:
    """A file mapped privately (copy-on-write: views are writable arrays, and nothing reaches the file)."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as file:
            empty = file.seek(0, 2) == 0
            self.buffer = bytearray() if empty else mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        if not empty:
            _maps.add(self.buffer)

    def array(self, offset: int, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        """The bytes from `offset` as an array of `dtype` and `shape` (a view of the map, which it keeps open)."""
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self.buffer, dtype, count, offset).reshape(shape)


def _base(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def forget_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages of a tensor that is a view of a mapped file (nothing for any other tensor): they no
    longer count in this process's memory, and are read from the file again if the tensor is."""
    if tensor.numel() == 0:
        return
    start = tensor.data_ptr()
    end = start + (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()
    for buffer in list(_maps):
        base = _base(buffer)
        if base <= start and end <= base + len(buffer):
            first = (start - base) // mmap.PAGESIZE * mmap.PAGESIZE
            buffer.madvise(mmap.MADV_DONTNEED, first, min(end - base, len(buffer)) - first)
            return
