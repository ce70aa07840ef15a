"""Capturing a forward's kernel calls once and replaying them without Python, as CUDA graphs do on a GPU.

A one-token forward of the shipped target runs about 70 kernel calls; run one by one from Python, their
dispatch cost about as much as the kernels themselves (docs/bench/forward-profile.md). A forward whose every
computing step is one of verispec's kernels can instead be recorded while it runs (`capturing`) and replayed as one C
call (`Program`): the same kernels, with the same arguments, in the same order, so the same bits. The arguments are
pointers, so a replay reads whatever the recorded tensors hold then: the caller copies new inputs into the tensors
the capture read them from, and the outputs appear in the tensors it wrote them to (models/captured.py).

While capturing, any PyTorch op that computes (anything but views and allocation) raises `NotCapturable`: a replay
would skip it silently. The caller then runs that forward eagerly, as before.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verispec.kernels.build import library


class NotCapturable(RuntimeError):
    """A captured forward ran a PyTorch op that computes: a replay would leave it out."""


class Capture:
    """The kernel calls of one forward, in order, and every tensor they touched (kept alive for the replays)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Sequence[int]]] = []
        self.tensors: list[torch.Tensor] = []

    def add(self, kernel: int, args: Sequence[int], tensors: Sequence[torch.Tensor | None]) -> None:
        self.calls.append((kernel, list(args)))
        self.tensors.extend(t for t in tensors if t is not None)

    def program(self) -> Program:
        return Program(self.calls, self.tensors)


class Program:
    """Recorded kernel calls, replayed by one C call (kernels/replay.cpp)."""

    def __init__(self, calls: Sequence[tuple[int, Sequence[int]]], tensors: Sequence[torch.Tensor]) -> None:
        words = [word for kernel, args in calls for word in (kernel, len(args), *args)]
        self.code = torch.tensor(words, dtype=torch.int64)
        self.calls, self.tensors = len(calls), list(tensors)
        self.replay = library().vs_replay

    def __call__(self) -> None:
        failed = self.replay(self.code.data_ptr(), self.calls)
        if failed:  # a kernel that checks its inputs (a position past the rotary table) refused call `failed - 1`
            raise ValueError(f"a captured kernel call ({failed - 1} of {self.calls}) refused its inputs")


_capture: ContextVar[Capture | None] = ContextVar("verispec_capture", default=None)
_ADDRESSES: dict[str, int] = {}


def note(name: str, args: Sequence[int], tensors: Sequence[torch.Tensor | None]) -> None:
    """Record that kernel `name` just ran on `args`, touching `tensors`, if a forward is being captured."""
    capture = _capture.get()
    if capture is not None:
        if name not in _ADDRESSES:
            _ADDRESSES[name] = ctypes.cast(getattr(library(), f"vs_{name}"), ctypes.c_void_p).value
        capture.add(_ADDRESSES[name], args, tensors)


class _ViewsOnly(TorchDispatchMode):
    """Let through the PyTorch ops a replay needs not repeat (views, allocation); refuse any other."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket is torch.ops.aten.empty):
            raise NotCapturable(f"{func} computes outside verispec's kernels")
        return func(*args, **(kwargs or {}))


@contextmanager
def capturing() -> Iterator[Capture]:
    """Record the kernel calls made inside (in this thread or task), refusing PyTorch ops that compute."""
    capture = Capture()
    token = _capture.set(capture)
    try:
        with _ViewsOnly():
            yield capture
    finally:
        _capture.reset(token)
