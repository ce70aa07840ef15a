"""Capturing a forward's kernel calls once and replaying them without Python, as CUDA graphs do on a GPU.

A one-token forward runs several kernel calls a layer; run one by one from Python, their dispatch is a large share of
a small model's step (docs/bench/forward-profile.md measures it). A forward whose every
computing step is one of verispec's kernels can instead be recorded while it runs (`capturing`) and replayed as one C
call (`Program`): the same kernels, with the same arguments, in the same order, so the same bits. The arguments are
pointers, so a replay reads whatever the recorded tensors hold then: the caller copies new inputs into the tensors
the capture read them from, and the outputs appear in the tensors it wrote them to; a pointer into memory that
changes between replays (another KV cache) is rewritten in the program first (models/captured.py). `Capture`
notes what each pointer argument points into, so that the caller can tell which.

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
    """The kernel calls of one forward, in order, and what each pointer argument pointed into."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.pointers: list[tuple[int, int, object]] = []  # (call, argument, the tensor or cell it points into)

    def add(self, kernel: int, words: Sequence[int], args: Sequence[object]) -> None:
        for position, arg in enumerate(args):
            if isinstance(arg, (torch.Tensor, ctypes.c_int64)):
                self.pointers.append((len(self.calls), position, arg))
        self.calls.append((kernel, list(words)))

    def program(self) -> Program:
        return Program(self.calls)


class Program:
    """Recorded kernel calls, replayed by one C call (kernels/replay.cpp). `word(call, argument)` is where an argument
    sits in `code`, so that a caller can point it elsewhere (`code[word] = address`) before a replay."""

    def __init__(self, calls: Sequence[tuple[int, Sequence[int]]]) -> None:
        self.kernels = [kernel for kernel, _ in calls]
        words, self.starts = [], []
        for kernel, args in calls:
            self.starts.append(len(words) + 2)
            words += [kernel, len(args), *args]
        self.code = torch.tensor(words, dtype=torch.int64)
        self.calls = len(calls)
        self.replay = library().vs_replay

    def word(self, call: int, argument: int) -> int:
        return self.starts[call] + argument

    def __call__(self) -> None:
        self._check(self.replay(self.code.data_ptr(), self.calls))

    def timed(self, repeats: int) -> dict[str, float]:
        """Replay `repeats` times, timing each call: the median seconds a replay spends in each kernel, by name (a
        program run inside this one counts as "run")."""
        names = {address: name for name, address in _ADDRESSES.items()}
        runs = []
        for _ in range(repeats):
            seconds = torch.zeros(self.calls, dtype=torch.float64)
            self._check(library().vs_replay_timed(self.code.data_ptr(), self.calls, seconds.data_ptr()))
            runs.append(seconds)
        median = torch.stack(runs).median(0).values
        by_name: dict[str, float] = {}
        for kernel, seconds in zip(self.kernels, median.tolist()):
            by_name[names[kernel]] = by_name.get(names[kernel], 0.0) + seconds
        return by_name

    def _check(self, failed: int) -> None:
        if failed:  # a kernel that checks its inputs (a token id or position past its table) refused call `failed - 1`
            raise IndexError(
                f"a captured kernel call ({failed - 1} of {self.calls}) refused its inputs: an index out of range"
            )


_capture: ContextVar[Capture | None] = ContextVar("verispec_capture", default=None)
_ADDRESSES: dict[str, int] = {}


def kernel_address(name: str) -> int:
    """Where kernel `name` (`vs_<name>`) starts: a program's calls name their kernels so."""
    if name not in _ADDRESSES:
        _ADDRESSES[name] = ctypes.cast(getattr(library(), f"vs_{name}"), ctypes.c_void_p).value
    return _ADDRESSES[name]


def note(name: str, words: Sequence[int], args: Sequence[object]) -> None:
    """Record that kernel `name` just ran on `words` (from `args`), if a forward is being captured."""
    capture = _capture.get()
    if capture is not None:
        capture.add(kernel_address(name), words, args)


def _storages(tree: object) -> set[int]:
    """The storages of the tensors in nested tuples, lists and dicts (an op's arguments or outputs): by hand, as
    pytree's general walk made most of a capture's cost (an op's outputs and arguments are checked at every op)."""
    found, left = set(), [tree]
    while left:
        item = left.pop()
        if isinstance(item, torch.Tensor):
            found.add(item.untyped_storage().data_ptr())
        elif isinstance(item, (tuple, list)):
            left.extend(item)
        elif isinstance(item, dict):
            left.extend(item.values())
    return found


class _ViewsOnly(TorchDispatchMode):
    """Let through the PyTorch ops a replay need not repeat (allocation, and views that alias their input); refuse
    any other. Some ops declared as views copy when they must (reshape, contiguous, .to in inference mode): their
    outputs are checked to share their input's memory."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled, and wrapping the mode for Dynamo imports torch._dynamo, which
        # costs a CLI call's first token more than the rest of its forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten.empty:
            return func(*args, **kwargs)
        if not func.is_view:
            raise NotCapturable(f"{func} computes outside verispec's kernels")
        out = func(*args, **kwargs)
        if (
            isinstance(out, torch.Tensor)
            and args
            and isinstance(args[0], torch.Tensor)
            and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
        ):
            return out  # the usual view, of its first argument
        if not _storages(out) <= _storages((args, kwargs)):
            raise NotCapturable(f"{func} copied its input here")
        return out


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
