"""A source file's bytes, decompressed on the fly when its name ends in `.gz`, `.zst` or `.zstd`.

The decompressed bytes are counted: more than `MAX_EXPANSION` times the file's size (and more than
`BOMB_FLOOR_BYTES`) is refused as a compression bomb. Each piece that comes out of the decompressor stays
bounded (zstd is fed `_ZSTD_INPUT` bytes at a time), and a zstd file that ends inside a frame is an
`OSError`, like a truncated gzip file.
"""

from __future__ import annotations

import gzip
import io
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
BOMB_FLOOR_BYTES = 256 * 1024**2  # a compressed file may always decompress to this much
MAX_EXPANSION = 1000  # ... and to at most this many times its own size beyond that
CHUNK = 1 << 20  # bytes read at a time where no line structure bounds the read
_ZSTD_INPUT = 512  # compressed bytes fed to zstd at a time: at most ~16 MiB come out of one feed


def compression(path: Path) -> str | None:
    """The compression suffix of `path` (`.gz`, `.zst`, `.zstd`), or None."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


class _Inflated(io.RawIOBase):
    """Decompressed bytes, taken piece by piece from `pieces` (b"" at the end) and counted: beyond `cap`
    bytes in all, the file is refused as a compression bomb."""

    def __init__(self, pieces: Callable[[], bytes], cap: int, path: Path) -> None:
        super().__init__()
        self._pieces, self._cap, self._path = pieces, cap, path
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
            if self._count > self._cap:
                raise UpcyclerError(
                    f"{shown_path(self._path)}: decompresses to more than {MAX_EXPANSION}x its size (a "
                    "compression bomb?); check the file or decompress it yourself"
                )
            self._pending = memoryview(piece)
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count


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
def open_binary(path: Path) -> Iterator[BinaryIO]:
    """The bytes of the regular file `path`, decompressed (and counted) when it ends in a compression
    suffix."""
    with os.fdopen(open_regular(path, "source file"), "rb") as raw:
        kind = compression(path)
        if kind is None:
            yield raw
            return
        cap = max(BOMB_FLOOR_BYTES, MAX_EXPANSION * os.fstat(raw.fileno()).st_size)
        if kind == ".gz":
            pieces = partial(gzip.GzipFile(fileobj=raw, mode="rb").read, CHUNK)
        else:
            pieces = partial(next, _zstd_pieces(raw, path), b"")
        yield io.BufferedReader(_Inflated(pieces, cap, path), CHUNK)
