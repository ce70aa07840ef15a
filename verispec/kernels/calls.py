"""How the Python side calls a kernel: the name of a dtype's build of it, the checks every wrapper shares, and the call
itself, with pointers given as the tensors or cells they point to (noted while a forward is being captured)."""

from __future__ import annotations

import ctypes
import struct
from typing import Sequence, Union

import torch

from verispec.kernels.build import library
from verispec.kernels.capture import note

SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}  # the dtypes the kernels run, by their name's suffix


def available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the kernels run `dtype` tensors on `device` here (built on first call)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # (each step asks)
    return kind == "cpu" and dtype in SUFFIX and library() is not None


def widened(x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether float32 rows `x` go with a float16 cache's keys and values (on the CPU)."""
    return (
        x.dtype == torch.float32
        and keys.dtype == values.dtype == torch.float16
        and keys.device.type == values.device.type == "cpu"
    )


def kernel_for(name: str, *tensors: torch.Tensor) -> str:
    """The kernel `name` for these tensors' one dtype, after checking that they are CPU tensors of it."""
    dtype = tensors[0].dtype
    if dtype not in SUFFIX or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        raise ValueError(
            f"verispec's {name} takes CPU float32 or bfloat16 tensors of one dtype; got "
            f"{[(t.dtype, t.device.type) for t in tensors]}"
        )
    return f"{name}_{SUFFIX[dtype]}"


Arg = Union[int, torch.Tensor, ctypes.c_int64, None]  # a number, or what a pointer points to (None: a null pointer)


def address(arg: Arg) -> int:
    """The word a kernel takes for `arg`: a tensor's data pointer, a cell's address, 0 for None, a number itself."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    if isinstance(arg, ctypes.c_int64):
        return ctypes.addressof(arg)
    return 0 if arg is None else arg


def call(name: str, args: Sequence[Arg]) -> int:
    """Run kernel `name` on its arguments, pointers given as the tensors or cells they point to (and record the
    call if a forward is being captured, with what each pointer points into); its status."""
    words = [address(arg) for arg in args]
    status = getattr(library(), f"vs_{name}")((ctypes.c_int64 * len(words))(*words))
    if status == 0:
        note(name, words, args)
    return status


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as rows (R, D) with a unit last stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def float_bits(x: float) -> int:
    """A float32's bits, as a kernel takes a float argument."""
    return struct.unpack("<I", struct.pack("<f", x))[0]
