"""A small, fast reader of GGUF headers: metadata and tensor infos, never tensor data.

`gguf.GGUFReader` builds one numpy view per array element, which takes ~11 s on a Qwen header (151,936
tokens and as many merges). Walking the same header with `struct` takes a fraction of a second, and it lets
`check_gguf_file` say *why* a file is unusable (missing, not GGUF, header cut short, tensor data cut short)
before llama.cpp gets to crash on it.

Layout (GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 kv count; kv pairs (string key, u32
value type, value); tensor infos (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset
relative to the data section); padding to `general.alignment` (default 32); tensor data.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specserve.models.errors import GGUFFileError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    ggml_type: int
    offset: int  # relative to GGUFHeader.data_offset
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # scalars, str, tuple[str, ...] or 1-D numpy arrays
    tensors: tuple[TensorInfo, ...]
    data_offset: int  # absolute offset of the tensor data section
    file_size: int

    @property
    def required_size(self) -> int:
        """Bytes the file must have to hold every tensor."""
        return max((self.data_offset + t.offset + t.n_bytes for t in self.tensors), default=self.data_offset)


class _Cursor:
    """Sequential little- or big-endian reads over a buffer; struct.error when it runs past the end."""

    def __init__(self, buf: mmap.mmap, endian: Literal["<", ">"]) -> None:
        self.buf, self.endian, self.pos = buf, endian, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.endian + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw_string(self) -> bytes:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise struct.error(f"string of {n} bytes runs past the end of the file")
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def string(self) -> str:
        return self.raw_string().decode("utf-8", errors="surrogateescape")

    def value(self, value_type: int, keep: bool) -> Any:
        if value_type == _STRING:
            return self.string() if keep else self.raw_string()
        if value_type == _ARRAY:
            return self.array(keep)
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])

    def array(self, keep: bool) -> Any:
        item_type, count = self.scalar("I"), self.scalar("Q")
        if item_type in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[item_type]).newbyteorder(self.endian)
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise struct.error(f"array of {count} items runs past the end of the file")
            items = np.frombuffer(self.buf[self.pos : end], dtype=dtype) if keep else None
            self.pos = end
            return items
        if item_type == _STRING and not keep:
            for _ in range(count):  # skip without decoding (e.g. 151k BPE merges)
                self.pos += 8 + self.scalar("Q")
            if self.pos > len(self.buf):
                raise struct.error("string array runs past the end of the file")
            return None
        return tuple(self.value(item_type, keep) for _ in range(count))


def read_header(path: Path | str, keys: Collection[str] | None = None) -> GGUFHeader:
    """Parse a GGUF header, keeping the metadata values named in `keys` (all when None)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFFileError(f"{path}: no such file")
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        if head != GGUF_MAGIC:
            raise GGUFFileError(f"{path}: not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(path, buf, file_size, keys)
            except (struct.error, ValueError, KeyError) as e:
                raise GGUFFileError(f"{path}: unreadable GGUF header ({e})") from None


def _parse(path: Path, buf: mmap.mmap, file_size: int, keys: Collection[str] | None) -> GGUFHeader:
    (version,) = struct.unpack_from("<I", buf, 4)
    endian: Literal["<", ">"] = ">" if version & 0xFFFF == 0 else "<"  # big-endian reads as version << 16
    cursor = _Cursor(buf, endian)
    cursor.pos = 4
    version = cursor.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cursor.scalar("Q"), cursor.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cursor.string()
        keep = keys is None or key in keys or key == "general.alignment"
        value = cursor.value(cursor.scalar("I"), keep)
        if keep:
            metadata[key] = value
    tensors = tuple(_tensor_info(cursor) for _ in range(n_tensors))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_offset = -(-cursor.pos // alignment) * alignment
    return GGUFHeader(path, version, metadata, tensors, data_offset, file_size)


def _tensor_info(cursor: _Cursor) -> TensorInfo:
    name = cursor.string()
    shape = tuple(int(cursor.scalar("Q")) for _ in range(cursor.scalar("I")))
    ggml_type, offset = cursor.scalar("I"), cursor.scalar("Q")
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n_elements = int(np.prod(shape, dtype=np.int64))
    return TensorInfo(name, shape, ggml_type, offset, n_elements * type_size // block_size)


def check_gguf_file(path: Path | str) -> GGUFHeader:
    """Raise GGUFFileError unless `path` is a GGUF file long enough for all of its tensors."""
    header = read_header(path, keys=())
    if header.file_size < header.required_size:
        raise GGUFFileError(
            f"{header.path}: truncated GGUF file: {header.file_size} bytes, "
            f"but its tensor data needs {header.required_size} bytes"
        )
    return header
