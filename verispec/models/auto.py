"""One entry point for loading: the native runtime where it covers the architecture, transformers elsewhere."""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.errors import CheckpointError, InvalidArgumentError, UnsupportedArchitectureError
from verispec.models.precision import DEFAULT_DTYPE
from verispec.models.protocol import CausalLM

BACKENDS = ("auto", "native", "transformers")


def load(
    name_or_path: str | Path,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    *,
    exact: bool = False,
    quantize: str | None = None,
    kv_dtype: str | torch.dtype = "auto",
) -> CausalLM:
    """`auto` tries the native runtime and falls back to transformers for an architecture it does not implement.
    `dtype` auto (the default, as the commands' --dtype: precision.DEFAULT_DTYPE) is the native runtime's
    `auto_dtype` (a GGUF file's own formats; for a folder bfloat16 where verispec's kernels run, else float32) and
    float32 on transformers, asked for or fallen back to; `dtype="float32"` upcasts on either. `exact`
    (batch-invariant forwards), `quantize` (weights kept in a block format) and `kv_dtype` (what the caches hold,
    `precision.kv_dtype_of`) are the native runtime's."""
    from verispec.models.hf_adapter import load_transformers_model
    from verispec.models.native import load_model

    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    native_only = (
        "exact mode" if exact else "quantizing" if quantize else "a cache dtype" if kv_dtype != "auto" else None
    )
    if backend == "transformers" and native_only:
        raise InvalidArgumentError(f"{native_only} is a mode of the native runtime; transformers has none")
    if backend == "transformers":
        return load_transformers_model(name_or_path, device, dtype)
    try:
        return load_model(name_or_path, device, dtype, exact=exact, quantize=quantize, kv_dtype=kv_dtype)
    except UnsupportedArchitectureError as unsupported:
        if backend == "native" or native_only:
            raise
        try:
            return load_transformers_model(name_or_path, device, dtype)
        except CheckpointError as err:
            raise UnsupportedArchitectureError(f"{unsupported}, and transformers failed too: {err}") from None
