"""Opening a GGUF file (llama.cpp's one-file checkpoint) with the `gguf` package, and reading its metadata as typed
values: each way a file can be broken becomes a `CheckpointError` that says which."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor

from verispec.errors import CheckpointError
from verispec.models.checkpoint import unreadable

SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file rather than a checkpoint folder: a `.gguf` name, or any file (a folder is
    never one)."""
    path = Path(path)
    return path.suffix.lower() == SUFFIX or path.is_file()


class _Truncated(Exception):
    """The file ends before the bytes its header promises."""


class _Reader(GGUFReader):
    """`GGUFReader`, told to say so when a read would run past the end of the file: numpy's memory map hands back
    a short array there, which the reader would report as a failed view, reshape or index further on."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Truncated(f"it holds {len(self.data)} bytes; its header says there is data up to byte {end}")
        return super()._get(offset, dtype, count, override_order)


class GGUFFile:
    """A GGUF file's metadata and tensors (`tensors`, by GGUF name; their data is mapped, not read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            os.close(os.open(self.path, os.O_RDONLY))
            reader = _Reader(self.path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such GGUF file") from None
        except OSError as err:
            raise unreadable(path, err) from None
        except _Truncated as err:
            raise CheckpointError(f"{path}: truncated GGUF file ({err})") from None
        except (ValueError, KeyError, IndexError, UnicodeDecodeError) as err:
            if self.path.stat().st_size == 0 or "magic" in str(err):
                raise CheckpointError(f"{path}: not a GGUF file (it does not begin with GGUF's magic bytes)") from None
            raise CheckpointError(f"{path}: corrupt GGUF file ({err})") from None
        self.reader = reader
        self.tensors: dict[str, ReaderTensor] = {tensor.name: tensor for tensor in reader.tensors}

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """The value under `key` (`default` where there is none), refused unless it is of `kind` (a `list` kind
        for arrays)."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: metadata {key} is not UTF-8 text") from None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise CheckpointError(f"{self.path}: metadata {key} is {type(value).__name__} {_short(value)}, not "
                                  f"{' or '.join(k.__name__ for k in kinds)}")
        return value

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """The value under `key`, which the file must have."""
        value = self.get(key, kind)
        if value is None:
            raise CheckpointError(f"{self.path}: no {key} in its metadata")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
