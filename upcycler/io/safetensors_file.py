"""The safetensors file format, read and written by us so that both stream and both are validated.

Format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON `{name: {dtype, shape, data_offsets},
…, "__metadata__": {…}}` (our writer pads it with spaces), then the raw little-endian tensor bytes, whose
offsets are relative to the end of the header.

- `read_header` validates a file completely before any tensor is read (a truncated shard is caught here).
  It accepts exactly the files the official `safetensors` library (0.8) accepts, by the same rules:
  1. the file is a regular file of at least 8 bytes; N <= 100,000,000 and 8 + N <= the file size;
  2. the header is valid UTF-8 and strict JSON: no NaN/Infinity, no unpaired `\\u` surrogate escape, no
     number beyond the float range, no nesting deeper than 127 arrays/objects (serde_json's limit);
  3. the header is an object; `__metadata__` appears at most once and is null or an object of string
     values (a repeated metadata key keeps its last value);
  4. every other key names a tensor whose value is an object with `dtype`, `shape` and `data_offsets`,
     each at most once (other keys are ignored), or the array `[dtype, shape, data_offsets]`;
     `dtype` is a dtype name the format defines, as a string or as `{"NAME": null}`; `shape` is an array
     and `data_offsets` an array of two, all non-negative JSON integers below 2**64 (`1.0`, `-0`, `true`
     are not integers);
  5. sorted by `data_offsets`, the first tensor begins at 0 and each next one where the previous ended
     (no overlap, no gap), and each is exactly as long as its shape needs: the element count and the bit
     count must not overflow 64 bits and the bit count must be whole bytes;
  6. the last tensor ends exactly at the end of the file: no truncation, no trailing bytes.
  Two deliberate differences, both refusals: a tensor name listed twice (the official reader silently
  keeps the last entry; which one the writer meant is unknowable), and a tensor we cannot hold is "not
  supported" rather than read: a dtype the format defines but numpy lacks (F8_*, F4, F6_*, U16, U32, U64,
  C64), more than 32 dimensions, or (possible only when the tensor is empty) non-zero dimensions whose
  product is 2**63 bytes or more.
- `lazy_tensor` reads one tensor (or one row of it, for `LazyTensor.part`) with `os.preadv` into a fresh
  array: no mmap, so resident memory stays one tensor whatever the file size.
- `ShardWriter` writes a shard whose header is known up front, tensor by tensor, through
  `io.writeback.StreamingFile` (page cache kept small); each slice is hashed on a digest thread while the
  next ones are written, and a tensor stored unchanged in a source file is streamed from it (`copy`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from upcycler.errors import UpcyclerError
from upcycler.io.writeback import SLICE, StreamingFile
from upcycler.tensors import BF16, LazyTensor, StoredBytes
from upcycler.untrusted import describe, escape, open_regular, shown_path

_DTYPES: dict[str, np.dtype] = {
    "BF16": BF16, "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# Every dtype the format defines, with its size in bits (we hold only those in _DTYPES).
_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
         "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
         "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
_FIELDS = ("dtype", "shape", "data_offsets")
MAX_HEADER = 100_000_000  # the official reader's limit
_MAX_NESTING = 127  # arrays/objects inside each other, the header object included (serde_json's limit)
_MAX_DIMS = 32  # numpy 1 holds at most 32 dimensions, numpy 2 at most 64
_U64 = 2**64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
# One thread per digest, so each digest's slices are hashed in the order they were written: the output
# shard's sha256, and the source's digest watch (for bytes streamed from it). The writing thread never
# waits for either until a buffer is to be reused or the call ends: on two cores, hashing and the
# kernel's copying overlap instead of taking turns.
_OUTPUT_DIGEST = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256-output")
_SOURCE_DIGEST = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256-source")
# ... and each tensor's own digest (xxh3-128 of its C-order bytes: a tenth of sha256's time), what a
# write's function check compares with the bytes the tensor should hold
_TENSOR_DIGEST = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xxh3-tensor")
_RING = 3  # `copy`'s read buffers; the digests lag the write head by at most this many slices


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
    """All tensor entries (in header order) and the metadata of one safetensors file, after checking it is
    whole and well-formed by the rules in the module docstring; anything else is one `UpcyclerError`
    naming the file. Reads only the 8-byte length and the header; the file is never modified."""
    try:
        with os.fdopen(open_regular(path, "safetensors file"), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise _corrupt(path, f"{len(raw)} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise _corrupt(path, f"header length {n:,} is over the {MAX_HEADER:,}-byte limit")
            if 8 + n > size:
                raise _corrupt(path, f"header length {n:,} is larger than the file")
            raw = f.read(n)
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot read ({err.strerror}); "
                            "check the file and its permissions") from None
    if len(raw) < n:
        raise _corrupt(path, "the file shrank while its header was read")
    tensors, metadata = _tensor_infos(path, _parse(path, raw))
    base, end = 8 + n, _check_layout(path, tensors)
    if base + end > size:
        raise UpcyclerError(f"{shown_path(path)}: file is truncated ({size:,} bytes, its tensors end at byte "
                            f"{base + end:,}); re-download or re-copy this shard")
    if base + end < size:
        raise _corrupt(path, f"{size - base - end:,} stray bytes after the last tensor")
    entries = {}
    for name, (dtype, shape, (begin, stop)) in tensors.items():
        if dtype not in _DTYPES:
            raise UpcyclerError(
                f"{shown_path(path)}: tensor {describe(name)} has dtype {dtype}, which is not supported "
                f"(supported: {', '.join(_DTYPES)}); convert the checkpoint to one of these first")
        if len(shape) > _MAX_DIMS or prod(d for d in shape if d) * _DTYPES[dtype].itemsize >= 2**63:
            raise UpcyclerError(
                f"{shown_path(path)}: tensor {describe(name)} has shape {_kind(list(shape))}, which is not "
                f"supported (at most {_MAX_DIMS} dimensions, whose non-zero product is below 2**63 bytes); "
                "re-export the checkpoint without it")
        entries[name] = TensorEntry(path, name, shape, _DTYPES[dtype], base + begin, stop - begin)
    return entries, metadata or {}


class _Pairs(list):
    """A JSON object as its (key, value) pairs in file order, so repeated keys stay visible."""


def _parse(path: Path, raw: bytes) -> Any:
    """The header's JSON, objects as `_Pairs`, numbers read as the official reader reads them."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _corrupt(path, f"header is not UTF-8 (byte {err.start})") from None
    try:
        value = json.loads(text, object_pairs_hook=_Pairs, parse_int=_json_int, parse_float=_json_float,
                           parse_constant=_json_constant)
    except RecursionError:
        raise _corrupt(path, "header JSON is nested too deeply") from None
    except (ValueError, OverflowError) as err:  # JSONDecodeError is a ValueError
        raise _corrupt(path, f"header is not valid JSON: {escape(str(err))[:120]}") from None
    stack = [(value, 1)]  # iteratively: nesting depth and unpaired surrogates, everywhere
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str) and _SURROGATE.search(item):
            raise _corrupt(path, "header has an unpaired \\u surrogate escape")
        if isinstance(item, list):
            if depth > _MAX_NESTING:
                raise _corrupt(path, f"header JSON is nested more than {_MAX_NESTING} levels deep")
            children = (x for pair in item for x in pair) if isinstance(item, _Pairs) else item
            stack.extend((child, depth + 1) for child in children)
    return value


def _json_int(literal: str) -> int | float:
    """A JSON integer as serde_json reads it: exact within 64 bits, else a float (`-0` is a float too)."""
    if len(literal) > 320:
        raise ValueError("number out of range")
    value = int(literal)
    if literal == "-0":
        return -0.0
    return value if -(2**63) <= value <= _U64 else float(value)  # OverflowError beyond the float range


def _json_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise ValueError("number out of range")
    return value


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _tensor_infos(path: Path, header: Any) -> tuple[dict[str, tuple[str, tuple[int, ...], tuple[int, int]]],
                                                    dict[str, str] | None]:
    """Each tensor's (dtype name, shape, data_offsets) in header order, and the metadata (rules 3 and 4)."""
    if not isinstance(header, _Pairs):
        raise _corrupt(path, f"header is {_kind(header)}, not a JSON object")
    tensors: dict[str, tuple[str, tuple[int, ...], tuple[int, int]]] = {}
    metadata, seen = None, False
    for key, value in header:
        if key == "__metadata__":
            if seen:
                raise _corrupt(path, "__metadata__ is listed twice")
            metadata, seen = _metadata(path, value), True
        elif key in tensors:
            raise _corrupt(path, f"tensor {describe(key)} is listed twice")
        else:
            tensors[key] = _tensor_info(path, key, value)
    return tensors, metadata


def _metadata(path: Path, value: Any) -> dict[str, str] | None:
    """`__metadata__` as a dict (a repeated key keeps its last value), None when it is null."""
    if value is None:
        return None
    if not isinstance(value, _Pairs):
        raise _corrupt(path, f"__metadata__ is {_kind(value)}, not an object of strings")
    for key, item in value:
        if not isinstance(item, str):
            raise _corrupt(path, f"__metadata__ {describe(key)} is {_kind(item)}, not a string")
    return dict(value)


def _tensor_info(path: Path, name: str, value: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """One tensor's (dtype name, shape, data_offsets), typed as rule 4 says (its layout is checked later)."""
    where = f"tensor {describe(name)}"
    if isinstance(value, _Pairs):
        fields: dict[str, Any] = {}
        for key, item in value:
            if key in _FIELDS:
                if key in fields:
                    raise _corrupt(path, f"{where} lists {key} twice")
                fields[key] = item
        for key in _FIELDS:
            if key not in fields:
                raise _corrupt(path, f"{where} has no {key}")
        dtype, shape, offsets = (fields[key] for key in _FIELDS)
    elif type(value) is list and len(value) == 3:  # serde also reads a struct from a positional array
        dtype, shape, offsets = value
    else:
        raise _corrupt(path, f"{where} is {_kind(value)}, not an object with dtype, shape and data_offsets")
    if isinstance(dtype, _Pairs) and len(dtype) == 1 and dtype[0][1] is None:  # serde's {"F32": null}
        dtype = dtype[0][0]
    if not isinstance(dtype, str) or dtype not in _BITS:
        raise _corrupt(path, f"{where} has unknown dtype {describe(dtype)}")
    if type(shape) is not list:
        raise _corrupt(path, f"{where} shape is {_kind(shape)}, not a list of non-negative integers")
    for d in shape:
        if not _is_u64(d):
            raise _corrupt(path, f"{where} shape must hold non-negative integers, not {describe(d)}")
    if type(offsets) is not list or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        raise _corrupt(path, f"{where} data_offsets must be two non-negative integers, not {_kind(offsets)}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _U64


def _kind(value: Any) -> str:
    """A value from the header for a message: short lists shown whole, anything else described."""
    if type(value) is list and len(value) <= 8 and all(type(v) is int for v in value):
        return escape(str(value))[:200]
    return "an object" if isinstance(value, _Pairs) else describe(value)


def _check_layout(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]) -> int:
    """Rule 5: tensors sorted by offsets tile the data from byte 0 without overlap or gap; returns its end."""
    start, previous = 0, None
    for name, (dtype, shape, (begin, end)) in sorted(tensors.items(), key=lambda item: item[1][2]):
        where = f"tensor {describe(name)} data_offsets [{begin}, {end}]"
        if begin < start:
            raise _corrupt(path, f"{where} overlap tensor {describe(previous)}, which ends at {start}")
        if begin > start:
            raise _corrupt(path, f"{where} leave a gap of {begin - start:,} bytes after byte {start}")
        if end < begin:
            raise _corrupt(path, f"{where} end before they begin")
        count = 1
        for d in shape:
            count *= d
            if count > _U64:
                raise _corrupt(path, f"tensor {describe(name)} shape has 2**64 elements or more")
        bits = count * _BITS[dtype]
        if bits > _U64:
            raise _corrupt(path, f"tensor {describe(name)} of {count:,} {dtype} values is 2**64 bits or more")
        if bits % 8:
            raise _corrupt(path, f"tensor {describe(name)} of {count:,} {dtype} values is not whole bytes")
        if end - begin != bits // 8:
            raise _corrupt(path, f"{where} span {end - begin:,} bytes but shape {_kind(list(shape))} "
                                 f"of {dtype} needs {bits // 8:,}")
        start, previous = end, name
    return start


def _corrupt(path: Path, why: str) -> UpcyclerError:
    """The error for a file that breaks the format: names the file, says why, says how to fix it."""
    return UpcyclerError(f"{shown_path(path)}: not a valid safetensors file ({why}); "
                         "re-download or re-copy it")


def _pread_into(path: Path, offset: int, out: np.ndarray) -> np.ndarray:
    """Fill `out` with the bytes at `offset` of `path`, which must still be a regular file."""
    fd = open_regular(path, "safetensors file")  # not os.open: the file may have been swapped since
    try:
        _read_exact(fd, path, offset, memoryview(out.reshape(-1).view(np.uint8)))
    finally:
        os.close(fd)
    return out


def _read_exact(fd: int, path: Path, offset: int, view: memoryview) -> None:
    """Fill `view` with the bytes at `offset` of the open file `fd` (`path`, for errors)."""
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise UpcyclerError(f"{shown_path(path)}: file ended early while reading; "
                                    "re-download or re-copy this shard")
            done += got
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot read ({err.strerror}); "
                            "check the file and re-copy it if needed") from None


def lazy_tensor(entry: TensorEntry) -> LazyTensor:
    """A LazyTensor over one stored tensor; `part(i)` reads only row `i` of the leading axis."""

    def load() -> np.ndarray:
        return _pread_into(entry.path, entry.start, np.empty(entry.shape, entry.dtype))

    def part(i: int) -> np.ndarray:
        row = prod(entry.shape[1:]) * entry.dtype.itemsize
        return _pread_into(entry.path, entry.start + i * row, np.empty(entry.shape[1:], entry.dtype))

    return LazyTensor(entry.shape, entry.dtype, load, part if entry.shape else None, stored=stored_bytes(entry))


def stored_bytes(entry: TensorEntry, seen: Callable[[int, memoryview], None] | None = None) -> StoredBytes:
    """Where `entry`'s bytes are, for a writer that copies them (`ShardWriter.copy`)."""
    return StoredBytes(entry.path, entry.start, entry.nbytes, seen)


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
        self._out = StreamingFile(path)
        self._buffers = [memoryview(bytearray(SLICE)) for _ in range(_RING)]  # `copy`'s, used in turn
        self._lag: deque[list[Future]] = deque()  # each slice's digests not yet known done, oldest first
        self._slices = 0
        self._sha = hashlib.sha256()
        self._tensor_hashes: dict[str, xxhash.xxh3_128] = {}
        self.bytes_written = 0
        self._write(encode_header(items, metadata), None)

    def _write(self, data, tensor: xxhash.xxh3_128 | None) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), SLICE):
            piece = view[start:start + SLICE]  # keeps `data` alive until hashed
            self._hash(piece, tensor)
            self._out.write(piece)
        self.bytes_written += len(view)

    def write(self, name: str, array: np.ndarray) -> None:
        """Append `array` (all of tensor `name`, or the next part of it when written part by part).
        `array` must not change until `close`: its last slices may still be being hashed after return."""
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        self._write(data, self._expect(name, len(data)))

    def copy(self, name: str, stored: StoredBytes) -> None:
        """Append tensor `name` (or its next part) from where its bytes are stored, streamed through a
        ring of reused buffers: the same bytes `write` would append, without the whole array in memory.
        Every slice read is shown to `stored.seen` (the source's digest watch) and hashed into the shard's
        digest, each on its own thread, while the next slices are read and written."""
        tensor = self._expect(name, stored.nbytes)
        fd = open_regular(stored.path, "safetensors file")
        try:
            for start in range(0, stored.nbytes, SLICE):
                self._catch_up(_RING - 1)  # so the digests are done with the buffer used _RING slices ago
                piece = self._buffers[self._slices % _RING][:min(SLICE, stored.nbytes - start)]
                _read_exact(fd, stored.path, stored.offset + start, piece)
                self._hash(piece, tensor, stored.seen, stored.offset + start)
                self._out.write(piece)
        finally:
            os.close(fd)
        self.bytes_written += stored.nbytes

    def _hash(self, piece: memoryview, tensor: xxhash.xxh3_128 | None,
              seen: Callable[[int, memoryview], None] | None = None, offset: int = 0) -> None:
        """Hash the slice about to be written into the shard's digest and its tensor's (and show it to
        `seen`, the digest watch of the file it was read from at `offset`), on the digest threads, at most
        _RING slices behind."""
        self._catch_up(_RING - 1)
        futures = [_OUTPUT_DIGEST.submit(self._sha.update, piece)]
        if tensor is not None:
            futures.append(_TENSOR_DIGEST.submit(tensor.update, piece))
        if seen is not None:
            futures.append(_SOURCE_DIGEST.submit(seen, offset, piece))
        self._lag.append(futures)
        self._slices += 1

    def _catch_up(self, most: int) -> None:
        """Wait until at most `most` slices are still being hashed (raising a digest's error, if any)."""
        while len(self._lag) > most:
            _wait(self._lag.popleft())

    def _expect(self, name: str, nbytes: int) -> xxhash.xxh3_128:
        """Account for `nbytes` more of tensor `name`, which must be the one the header says comes next;
        return the digest its bytes go into."""
        expected_name, total = self._expected[self._next]
        if name != expected_name:
            raise AssertionError(f"shard {self.path.name}: expected {expected_name}, got {name}")
        digest = self._tensor_hashes.setdefault(name, xxhash.xxh3_128())
        self._pending += nbytes
        if self._pending > total:
            raise AssertionError(f"shard {self.path.name}: too many bytes for {name}")
        if self._pending == total:
            self._next += 1
            self._pending = 0
        return digest

    def close(self) -> str:
        """Flush to disk and return the sha256 of the whole file (`tensor_digests` then holds each tensor's)."""
        if self._next != len(self._expected):
            raise AssertionError(f"shard {self.path.name}: closed before every tensor was written")
        self._catch_up(0)
        self._out.close()
        return self._sha.hexdigest()

    @property
    def tensor_digests(self) -> dict[str, str]:
        """{name: xxh3-128 hex digest of its bytes} of every tensor written (complete after `close`)."""
        return {name: digest.hexdigest() for name, digest in self._tensor_hashes.items()}

    def abort(self) -> None:
        """Remove the partial file, once no digest thread still reads a slice of it."""
        for futures in self._lag:
            for future in futures:
                future.exception()
        self._lag.clear()
        self._out.abort()


def _wait(futures: list[Future]) -> None:
    """Wait for every one of `futures`, then raise the first one's error, if any."""
    for future in futures:
        future.exception()
    for future in futures:
        future.result()
