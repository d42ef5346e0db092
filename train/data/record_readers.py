"""Record files for `prepare-data`: ArrayRecord files and Megatron-LM indexed datasets.

ArrayRecord: each record one document, UTF-8 text (`arrayrecord`) or little-endian int32 token ids
(`arrayrecord-int32`), read `_RECORD_BATCH` records at a time. Megatron: the `.bin` memory-mapped with
the `.idx` of the same name next to it; every part of the index is checked against the files' lengths
(`_CHECK_ROWS` entries at a time) before a sequence is read, and each sequence comes out as int64 ids.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.data.source_files import Document, check_source_file, mapped, optional_module
from upcycler.untrusted import escape, shown_path

_RECORD_BATCH = 256  # ArrayRecord records read at a time
_CHECK_ROWS = 1 << 20  # Megatron index entries checked at a time
_FIX_MEGATRON = "rebuild the dataset with Megatron's preprocess_data.py"
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_MEGATRON_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # the integer codes
_ARRAY_RECORD_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


# --- ArrayRecord -------------------------------------------------------------------------------------


def arrayrecord_documents(path: Path, *, ids: bool) -> Iterator[Document]:
    """The records of an ArrayRecord file, `_RECORD_BATCH` at a time: UTF-8 text, or (`ids`) little-endian
    int32 token ids."""
    check_source_file(path)
    module = optional_module("array_record.python.array_record_module", path, "ArrayRecord", "array_record")

    def unreadable(err: object) -> UpcyclerError:
        return UpcyclerError(
            f"{shown_path(path)}: not a readable ArrayRecord file ({escape(str(err))[:120]}); the file may "
            "be truncated or corrupt"
        )

    try:
        reader = module.ArrayRecordReader(os.fspath(path), _ARRAY_RECORD_OPTIONS)
    except (RuntimeError, ValueError, OSError) as err:
        raise unreadable(err) from None
    if not reader.ok():  # nothing to close: closing a failed reader raises
        raise unreadable("no ArrayRecord footer")
    try:
        count = reader.num_records()
        for start in range(0, count, _RECORD_BATCH):
            try:
                records = reader.read(start, min(count, start + _RECORD_BATCH))
            except (RuntimeError, ValueError, OSError) as err:
                raise unreadable(err) from None
            for number, record in enumerate(records, start):
                yield from _record_document(record, number, path, ids)
    finally:
        reader.close()


def _record_document(record: bytes, number: int, path: Path, ids: bool) -> Iterator[Document]:
    """The document in one ArrayRecord record (nothing if empty)."""
    if not record:
        return
    if ids:
        if len(record) % 4:
            raise UpcyclerError(
                f"{shown_path(path)}: record {number} is {len(record):,} bytes, not whole int32 token ids; "
                "pass --format arrayrecord if the records are text"
            )
        yield np.frombuffer(record, "<i4").astype(np.int64)
        return
    try:
        text = record.decode("utf-8")
    except UnicodeDecodeError:
        raise UpcyclerError(
            f"{shown_path(path)}: record {number} is not UTF-8 text; pass --format arrayrecord-int32 if the "
            "records are token ids"
        ) from None
    if text:
        yield text


# --- Megatron indexed datasets -----------------------------------------------------------------------


def megatron_documents(path: Path) -> Iterator[np.ndarray]:
    """Each sequence of a Megatron-LM indexed dataset (`path` is its `.bin`) as an int64 array."""
    data = mapped(path, "Megatron data file")
    index_path = path.with_suffix(".idx")
    if not index_path.exists():
        raise UpcyclerError(
            f"{shown_path(index_path)}: missing; a Megatron dataset is read from its .bin with the .idx of "
            "the same name next to it"
        )
    dtype, sizes, pointers = _megatron_index(index_path)
    _check_extents(sizes, pointers, dtype.itemsize, len(data), index_path)
    for start in range(0, len(sizes), _CHECK_ROWS):  # a chunk of the index at a time as Python ints
        rows = slice(start, start + _CHECK_ROWS)
        for size, pointer in zip(sizes[rows].tolist(), pointers[rows].tolist()):
            if size:
                yield data[pointer : pointer + size * dtype.itemsize].view(dtype).astype(np.int64)


def _megatron_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, sizes, pointers) of a Megatron `.idx`, each part checked against the file's length."""
    shown = shown_path(path)
    index = mapped(path, "Megatron index")
    if len(index) < _MEGATRON_HEADER.size:
        raise UpcyclerError(f"{shown}: {len(index)} bytes, too short for a Megatron index; {_FIX_MEGATRON}")
    magic, version, code, count, documents = _MEGATRON_HEADER.unpack(index[: _MEGATRON_HEADER.size].tobytes())
    if magic != _MEGATRON_MAGIC:
        raise UpcyclerError(f"{shown}: not a Megatron index (no MMIDIDX header); pass the .bin of an "
                            "indexed dataset")
    if version != 1:
        raise UpcyclerError(f"{shown}: Megatron index version {version}, only 1 is read; {_FIX_MEGATRON}")
    if code not in _MEGATRON_DTYPES:
        raise UpcyclerError(f"{shown}: dtype code {code} is not an integer type; token ids must be integers")
    expected = _MEGATRON_HEADER.size + 12 * count + 8 * documents
    if expected != len(index):
        raise UpcyclerError(
            f"{shown}: {len(index):,} bytes, but its {count:,} sequences and {documents:,} documents need "
            f"{expected:,}; {_FIX_MEGATRON}"
        )
    sizes_at = _MEGATRON_HEADER.size
    sizes = index[sizes_at : sizes_at + 4 * count].view("<i4")
    pointers = index[sizes_at + 4 * count : sizes_at + 12 * count].view("<i8")
    _check_document_indices(index[sizes_at + 12 * count :].view("<i8"), count, path)
    return np.dtype(_MEGATRON_DTYPES[code]), sizes, pointers


def _check_document_indices(indices: np.ndarray, count: int, path: Path) -> None:
    """Refuse document boundaries that are not non-decreasing sequence numbers within [0, count]."""
    previous = 0
    for start in range(0, len(indices), _CHECK_ROWS):
        part = indices[start : start + _CHECK_ROWS]
        if part.min() < previous or part.max() > count or np.any(np.diff(part) < 0):
            raise UpcyclerError(
                f"{shown_path(path)}: document indices out of order or beyond the {count:,} sequences; "
                f"{_FIX_MEGATRON}"
            )
        previous = int(part[-1])


def _check_extents(sizes: np.ndarray, pointers: np.ndarray, itemsize: int, length: int, path: Path) -> None:
    """Refuse a sequence of the index `path` with a negative size or one that does not lie inside the `.bin`
    (`length` bytes)."""
    for start in range(0, len(sizes), _CHECK_ROWS):
        size = sizes[start : start + _CHECK_ROWS].astype(np.int64)
        pointer = pointers[start : start + _CHECK_ROWS]
        end = np.clip(pointer, 0, length) + size * itemsize  # clipped: no overflow past int64
        bad = (size < 0) | (pointer < 0) | (pointer > length) | (end > length)
        if bad.any():
            first = start + int(np.argmax(bad))
            raise UpcyclerError(
                f"{shown_path(path)}: sequence {first:,} (size {int(sizes[first]):,} at byte "
                f"{int(pointers[first]):,}) does not lie inside the {length:,}-byte .bin; {_FIX_MEGATRON}"
            )
