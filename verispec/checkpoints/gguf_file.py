"""Reading a GGUF file (llama.cpp's one-file checkpoint) as llama.cpp does: the file memory-mapped, its header
parsed once, metadata arrays as numpy arrays (strings as one list), each tensor a numpy view of the map (nothing
read until used). Each way a file can be broken becomes a `CheckpointError` that says which.

The layout (GGUF versions 2 and 3, little-endian): magic, version (uint32), tensor count, metadata count (uint64);
each metadata entry a key (string: uint64 length, UTF-8 bytes), a value type (uint32) and the value (an array: its
element type, uint32, its length, uint64, then the elements); each tensor's name, dimension count (uint32),
dimensions (uint64, innermost first), ggml type (uint32) and data offset (uint64); then, aligned to
`general.alignment` (default 32), the tensors' data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.checkpoints.folder import unreadable
from verispec.checkpoints.mapped import MappedFile
from verispec.errors import CheckpointError

SUFFIX = ".gguf"
MAGIC = b"GGUF"
VERSIONS = (2, 3)
ALIGNMENT = 32
# Metadata value types: numbers by their numpy dtype; 7 bool, 8 string, 9 array
NUMBERS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
BOOL, STRING, ARRAY = 7, 8, 9
# Tensor types numpy holds as numbers; the others are ggml's blocks, as bytes by row
ELEMENTS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file rather than a checkpoint folder: a `.gguf` name, or any file (a folder is
    never one)."""
    path = Path(path)
    return path.suffix.lower() == SUFFIX or path.is_file()


class _Corrupt(Exception):
    """The header says something no GGUF file says."""


class _Truncated(Exception):
    """The file ends before the bytes its header promises."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its name, dimensions (ggml's order: innermost first), type, and data (a view of the map: numbers
    as numpy holds them, shaped outermost first; ggml blocks as uint8 rows of bytes)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    """Reads the header front to back, refusing to run past the end of the file."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, size: int) -> int:
        """The offset of the next `size` bytes, which it moves past."""
        start, self.at = self.at, self.at + size
        if self.at > len(self.buffer):
            raise _Truncated(f"it holds {len(self.buffer)} bytes; its header says there is data up to byte {self.at}")
        return start

    def number(self, dtype: Any) -> Any:
        return np.frombuffer(self.buffer, dtype, 1, self.take(np.dtype(dtype).itemsize))[0].item()

    def bytes(self) -> bytes:
        size = self.number(np.uint64)
        start = self.take(size)
        return bytes(self.buffer[start : start + size])

    def value(self, kind: int) -> Any:
        """A metadata value: a number, bool, string (as bytes), or array (numbers as a numpy array, strings as a
        list of bytes)."""
        if kind in NUMBERS:
            return self.number(NUMBERS[kind])
        if kind == BOOL:
            return bool(self.number(np.uint8))
        if kind == STRING:
            return self.bytes()
        if kind != ARRAY:
            raise _Corrupt(f"unknown metadata value type {kind}")
        kind, count = self.number(np.uint32), self.number(np.uint64)
        if kind in NUMBERS or kind == BOOL:
            dtype = np.dtype(NUMBERS.get(kind, np.uint8))
            values = np.frombuffer(self.buffer, dtype, count, self.take(count * dtype.itemsize)).copy()
            return values.astype(bool) if kind == BOOL else values
        if kind == STRING:
            return self.strings(count)
        return [self.value(kind) for _ in range(count)]  # arrays of arrays: rare, and small

    def strings(self, count: int) -> list[bytes]:
        """`count` strings one after another (a vocabulary: 150k of them, so no per-string numpy calls)."""
        buffer, at, end, size_of = self.buffer, self.at, len(self.buffer), struct.Struct("<Q").unpack_from
        out: list[bytes] = []
        append = out.append
        try:
            for _ in range(count):
                (size,) = size_of(buffer, at)
                at += 8
                append(buffer[at : at + size].tobytes())
                at += size
        except struct.error:  # a length past the end
            pass
        if len(out) < count or at > end:
            raise _Truncated(f"it holds {end} bytes; its header runs past them")
        self.at = at
        return out


class GGUFFile:
    """A GGUF file's metadata and tensors (`tensors`, by GGUF name; their data is mapped, not read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._values: dict[str, Any] = {}  # metadata as Python values, made on first `get`
        try:
            self.map = MappedFile(self.path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such GGUF file") from None
        except OSError as err:
            raise unreadable(path, err) from None
        try:
            self.metadata, self.tensors = self._parse(memoryview(self.map.buffer))
        except _Truncated as err:
            raise CheckpointError(f"{path}: truncated GGUF file ({err})") from None
        except (_Corrupt, ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: corrupt GGUF file ({err})") from None

    def _parse(self, buffer: memoryview) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
        if len(buffer) < 4 or bytes(buffer[:4]) != MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (it does not begin with GGUF's magic bytes)")
        cursor = _Cursor(buffer)
        cursor.take(4)
        version = cursor.number(np.uint32)
        if version not in VERSIONS:
            byte_order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise CheckpointError(
                f"{self.path}: GGUF version {version}{byte_order}; verispec reads versions "
                f"{' and '.join(map(str, VERSIONS))}"
            )
        tensor_count, entries = cursor.number(np.uint64), cursor.number(np.uint64)
        metadata: dict[str, Any] = {}
        for _ in range(entries):
            key = cursor.bytes().decode()
            metadata[key] = cursor.value(cursor.number(np.uint32))
        infos = []
        for _ in range(tensor_count):
            name = cursor.bytes().decode()
            dims = tuple(cursor.number(np.uint64) for _ in range(cursor.number(np.uint32)))
            infos.append((name, dims, cursor.number(np.uint32), cursor.number(np.uint64)))
        alignment = metadata.get("general.alignment", ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")
        start = -(-cursor.at // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, dims, kind, offset in infos:
            if name in tensors:
                raise _Corrupt(f"two tensors named {name}")
            tensors[name] = self._tensor(name, dims, kind, start + offset, len(buffer))
        return metadata, tensors

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int, size: int) -> GGUFTensor:
        try:
            kind = GGMLQuantizationType(kind)
        except ValueError:
            raise _Corrupt(f"tensor {name} has unknown type {kind}") from None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if not dims or dims[0] % block:
            raise _Corrupt(f"tensor {name} of {list(dims)} is not whole {kind.name} blocks of {block}")
        shape = tuple(reversed(dims))
        elements = ELEMENTS.get(kind)
        if elements is None:  # blocks: bytes by row
            shape = (*shape[:-1], shape[-1] // block * block_bytes)
        count = int(np.prod(shape, dtype=np.uint64))
        end = offset + count * np.dtype(elements or np.uint8).itemsize
        if end > size:
            raise _Truncated(f"it holds {size} bytes; tensor {name} ends at byte {end}")
        return GGUFTensor(name, dims, kind, self.map.array(offset, elements or np.uint8, shape))

    def __contains__(self, key: str) -> bool:
        return key in self.metadata

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """The value under `key` (`default` where there is none), refused unless it is of `kind` (a `list` kind
        for arrays: strings as str, numbers as Python numbers)."""
        if key not in self.metadata:
            return default
        if key not in self._values:
            try:
                self._values[key] = _python(self.metadata[key])
            except UnicodeDecodeError:
                raise CheckpointError(f"{self.path}: metadata {key} is not UTF-8 text") from None
        value = self._values[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise CheckpointError(
                f"{self.path}: metadata {key} is {type(value).__name__} {_short(value)}, not "
                f"{' or '.join(k.__name__ for k in kinds)}"
            )
        return value

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """The value under `key`, which the file must have."""
        value = self.get(key, kind)
        if value is None:
            raise CheckpointError(f"{self.path}: no {key} in its metadata")
        return value


def _python(value: Any) -> Any:
    """A parsed metadata value as Python's own: text for bytes, lists for arrays."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [v.decode() for v in value] if value and isinstance(value[0], bytes) else [_python(v) for v in value]
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
