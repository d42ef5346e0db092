"""A source file's bytes, decompressed on the fly when its name ends in `.gz`, `.zst` or `.zstd`.

The decompressed bytes are counted against the compressed bytes read so far: once more than
`BOMB_FLOOR_BYTES` have come out, a running ratio above `max_expansion` (`MAX_EXPANSION` unless the user
raises it, `prepare-data --max-expansion`) is refused as a compression bomb. Real text compresses about
3-20x, so a bomb (deflate reaches ~1,030x, zstd far more) is refused after a few MiB of output, in
seconds and at bounded memory, wherever in the file its expansion sits. Each piece that comes out of the
decompressor stays bounded (zstd is fed `_ZSTD_INPUT` bytes at a time), and a zstd file that ends inside a
frame is an `OSError`, like a truncated gzip file. `declared_size` reads the decompressed size a file
declares, where it does so cheaply (for an estimate of the disk a preparation needs, never trusted).
"""

from __future__ import annotations

import gzip
import io
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from upcycler.errors import UpcyclerError
from upcycler.train.data.source_files import optional_module
from upcycler.untrusted import open_regular, shown_path

COMPRESSIONS = (".gz", ".zst", ".zstd")
BOMB_FLOOR_BYTES = 4 * 1024**2  # output always allowed before the ratio is checked (headers, tiny files)
MAX_EXPANSION = 100.0  # decompressed bytes per compressed byte read, beyond that: real text stays under ~20
CHUNK = 1 << 20  # bytes read at a time where no line structure bounds the read
_ZSTD_INPUT = 512  # compressed bytes fed to zstd at a time: at most ~16 MiB come out of one feed


def compression(path: Path) -> str | None:
    """The compression suffix of `path` (`.gz`, `.zst`, `.zstd`), or None."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


class _Inflated(io.RawIOBase):
    """Decompressed bytes, taken piece by piece from `pieces` (b"" at the end) and counted: beyond
    `BOMB_FLOOR_BYTES` in all, more than `max_expansion` of them per compressed byte `consumed()` so far
    refuses the file as a compression bomb."""

    def __init__(self, pieces: Callable[[], bytes], consumed: Callable[[], int], max_expansion: float,
                 path: Path) -> None:
        super().__init__()
        self._pieces, self._consumed, self._max_expansion, self._path = pieces, consumed, max_expansion, path
        self._count = 0
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        """A readable stream."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Fill `buffer` from the next decompressed piece; 0 at the end."""
        while not self._pending:
            piece = self._pieces()
            if not piece:
                return 0
            self._count += len(piece)
            if self._count > BOMB_FLOOR_BYTES:
                self._check_ratio()
            self._pending = memoryview(piece)
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def _check_ratio(self) -> None:
        """Refuse the file once its output so far exceeds `max_expansion` times its input so far."""
        seen = self._count / max(1, self._consumed())
        if seen > self._max_expansion:
            raise UpcyclerError(
                f"{shown_path(self._path)}: expands {seen:,.0f}x (more than --max-expansion "
                f"{self._max_expansion:g}; real text compresses at most ~20x): a compression bomb? If you "
                f"trust the file, pass --max-expansion {_above(seen)} or decompress it yourself"
            )


def _above(ratio: float) -> str:
    """A round --max-expansion that admits `ratio` (what this file showed so far)."""
    return str(10 ** math.ceil(math.log10(ratio * 1.01)))


def _zstd_pieces(raw: BinaryIO, path: Path) -> Iterator[bytes]:
    """The decompressed bytes of the zstd frames in `raw`, a small feed at a time (so a piece stays
    bounded); a file that ends inside a frame is an `OSError` (zstd's stream reader would stop silently)."""
    zstandard = optional_module("zstandard", path, "zstd files", "zstandard")
    decompressor = zstandard.ZstdDecompressor()
    frame, data = None, b""
    while True:
        if not data:
            data = raw.read(_ZSTD_INPUT)
            if not data:
                if frame is not None:
                    raise OSError("the file ends inside a zstd frame")
                return
        if frame is None:
            frame = decompressor.decompressobj()
        try:
            piece = frame.decompress(data)
        except zstandard.ZstdError as err:
            raise OSError(str(err)) from None
        data = b""
        if frame.eof:
            data, frame = frame.unused_data, None
        if piece:
            yield piece


@contextmanager
def open_binary(path: Path, max_expansion: float = MAX_EXPANSION) -> Iterator[BinaryIO]:
    """The bytes of the regular file `path`, decompressed (and counted, see the module docstring) when it
    ends in a compression suffix."""
    with os.fdopen(open_regular(path, "source file"), "rb") as raw:
        kind = compression(path)
        if kind is None:
            yield raw
            return
        if kind == ".gz":
            pieces = partial(gzip.GzipFile(fileobj=raw, mode="rb").read, CHUNK)
        else:
            pieces = partial(next, _zstd_pieces(raw, path), b"")
        yield io.BufferedReader(_Inflated(pieces, raw.tell, max_expansion, path), CHUNK)


def declared_size(path: Path) -> int | None:
    """The decompressed size the file at `path` declares, read from a few bytes of it: a gzip file's
    trailer (`_gzip_size`) or the content size of a zstd file's first frame (when the compressor recorded
    it); an uncompressed file's own size. None where unknown or unreadable: an estimate only, never a
    limit."""
    try:
        with os.fdopen(open_regular(path, "source file"), "rb") as raw:
            size = os.fstat(raw.fileno()).st_size
            kind = compression(path)
            if kind is None:
                return size
            if kind == ".gz":
                if size < 18:
                    return None
                raw.seek(size - 4)
                return _gzip_size(int.from_bytes(raw.read(4), "little"), size)
            return _zstd_content_size(raw.read(18), path)
    except (OSError, UpcyclerError):
        return None


def _gzip_size(isize: int, size: int) -> int:
    """The decompressed size of a gzip file of `size` bytes whose trailer says `isize` (its last member's
    size modulo 4 GiB): the least such size not below `size` (text does not shrink when inflated). Exact
    while the file expands by less than 4 GiB (all but the largest files), at least the truth beyond."""
    wraps = max(0, -(-(size - isize) // (1 << 32)))
    return isize + wraps * (1 << 32)


def _zstd_content_size(header: bytes, path: Path) -> int | None:
    """The content size a zstd frame `header` records, or None."""
    zstandard = optional_module("zstandard", path, "zstd files", "zstandard")
    try:
        declared = zstandard.frame_content_size(header)
    except zstandard.ZstdError:
        return None
    return declared if declared >= 0 else None
