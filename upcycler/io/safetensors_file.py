"""The safetensors file format, read and written by us so that both stream and both are validated.

Format: an 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}, …,
"__metadata__": {…}}` padded with spaces, then the raw little-endian bytes (offsets are relative to the
end of the header).

- `read_header` validates a file completely before any tensor is read: header length, JSON, dtypes,
  offsets consistent with the shapes and inside the file (a truncated shard is caught here).
- `lazy_tensor` reads one tensor (or one row of it, for `LazyTensor.part`) with `os.preadv` into a fresh
  array: no mmap, so resident memory stays one tensor whatever the file size.
- `ShardWriter` writes a shard whose header is known up front, tensor by tensor, hashing as it goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.tensors import BF16, LazyTensor

_DTYPES: dict[str, np.dtype] = {
    "BF16": BF16, "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024
_OVERLAP_MIN = 1 << 20  # writes at least this large are hashed concurrently with the write
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in a file."""

    path: Path
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    start: int  # absolute file offset of the first byte
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """All tensor entries and the metadata of one safetensors file, after checking it is whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise _corrupt(path, "shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise _corrupt(path, "header length is larger than the file")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _corrupt(path, "header is not valid JSON") from None
    except OSError as err:
        raise UpcyclerError(f"{path}: cannot read ({err.strerror}); check the file and its permissions") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    entries = {}
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"entry {name!r} has an unknown dtype or malformed shape/offsets") from None
        nbytes = prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise _corrupt(path, f"tensor {name!r} offsets do not match its shape")
        if base + end > size:
            raise UpcyclerError(
                f"{path}: file is truncated ({size} bytes, tensor {name!r} ends at {base + end}); "
                "re-download or re-copy this shard"
            )
        entries[name] = TensorEntry(path, name, shape, dtype, base + begin, nbytes)
    return entries, metadata


def _corrupt(path: Path, why: str) -> UpcyclerError:
    return UpcyclerError(f"{path}: not a valid safetensors file ({why}); re-download or re-copy it")


def _pread_into(path: Path, offset: int, out: np.ndarray) -> np.ndarray:
    view = memoryview(out.reshape(-1).view(np.uint8))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise UpcyclerError(f"{path}: file ended early while reading; re-download or re-copy this shard")
            done += got
    finally:
        os.close(fd)
    return out


def lazy_tensor(entry: TensorEntry) -> LazyTensor:
    """A LazyTensor over one stored tensor; `part(i)` reads only row `i` of the leading axis."""

    def load() -> np.ndarray:
        return _pread_into(entry.path, entry.start, np.empty(entry.shape, entry.dtype))

    def part(i: int) -> np.ndarray:
        row = prod(entry.shape[1:]) * entry.dtype.itemsize
        return _pread_into(entry.path, entry.start + i * row, np.empty(entry.shape[1:], entry.dtype))

    return LazyTensor(entry.shape, entry.dtype, load, part if entry.shape else None)


def encode_header(items: Iterable[tuple[str, tuple[int, ...], np.dtype]], metadata: dict[str, str]) -> bytes:
    """The length-prefixed, 8-byte aligned header for tensors written in the given order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in items:
        dtype = np.dtype(dtype)
        if dtype not in _NAMES:
            raise ValueError(f"dtype {dtype} cannot be stored in safetensors")
        n = prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes one shard: the header first, then each tensor's bytes in header order, hashing as it goes."""

    def __init__(self, path: Path, items: list[tuple[str, tuple[int, ...], np.dtype]], metadata: dict[str, str]):
        self.path = path
        self._expected = [(name, prod(shape) * np.dtype(dt).itemsize) for name, shape, dt in items]
        self._next = 0
        self._pending = 0
        self._file = open(path, "wb")
        self._sha = hashlib.sha256()
        self.bytes_written = 0
        self._write(encode_header(items, metadata))

    def _write(self, data) -> None:
        if len(data) < _OVERLAP_MIN:
            self._file.write(data)
            self._sha.update(data)
        else:  # hash on another thread while writing: both release the GIL, so this costs max(write, hash)
            hashed = _HASHER.submit(self._sha.update, data)
            self._file.write(data)
            hashed.result()
        self.bytes_written += len(data)

    def write(self, name: str, array: np.ndarray) -> None:
        """Append `array` (all of tensor `name`, or the next part of it when written part by part)."""
        expected_name, nbytes = self._expected[self._next]
        if name != expected_name:
            raise AssertionError(f"shard {self.path.name}: expected {expected_name}, got {name}")
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        self._write(data)
        self._pending += len(data)
        if self._pending > nbytes:
            raise AssertionError(f"shard {self.path.name}: too many bytes for {name}")
        if self._pending == nbytes:
            self._next += 1
            self._pending = 0

    def close(self) -> str:
        """Flush to disk and return the sha256 of the whole file."""
        if self._next != len(self._expected):
            raise AssertionError(f"shard {self.path.name}: closed before every tensor was written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._file.close()
