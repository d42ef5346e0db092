"""Check what is read from a checkpoint against the sha256 its manifest (`upcycler.json`) records.

An upcycler output records the sha256 of every file (HF) or of every tensor's C-order bytes (Orbax).
When a source has such a manifest, readers hand each byte range they read to a `DigestWatch`, which
hashes it on the fly when ranges arrive in order (the usual case: canonical order is file order) and
reads from disk only what was skipped. `Checkpoint.check_inputs()` completes every watch and compares;
writers call it before the output is renamed into place, so a corrupted source never yields a
finished-looking output. A file or tensor of which nothing was read is not checked (its bytes cannot
reach the output).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.untrusted import shown_path

_HEADER_LIMIT = 1 << 20  # a file's unread prefix up to this size (its header) is read at the first range
_CHUNK = 8 * 1024 * 1024

ReadRange = Callable[[int, int], bytes]  # (offset, length) -> bytes, straight from the stored object


@dataclass
class DigestWatch:
    """The sha256 of one stored object (a file, or one tensor's bytes), accumulated from what is read."""

    label: str  # what to name in an error: the file, or "file: tensor"
    size: int
    expected: str
    read_range: ReadRange
    chunk: int = _CHUNK  # how much `check` asks `read_range` for at a time
    prefix_gap: int = 0  # an unread prefix up to this size (a file's header) is read when the first range arrives
    _pos: int = 0
    _used: bool = False

    def __post_init__(self) -> None:
        self._sha = hashlib.sha256()
        self._lock = threading.Lock()

    def touch(self) -> None:
        """Mark the whole object as read (a file copied or parsed whole): `check` hashes it from disk."""
        with self._lock:
            self._used = True

    def saw(self, offset: int, data: bytes | memoryview) -> None:
        """`data` was read at `offset`; hash it now if it continues what has been hashed so far.

        Ranges that skip ahead are left for `check` (reading them now could read much more than the
        caller asked for), except a file's header before its first tensor.
        """
        with self._lock:
            self._used = True
            gap = offset - self._pos
            if self._pos == 0 and 0 < gap <= self.prefix_gap:
                self._sha.update(self.read_range(self._pos, gap))
                self._pos = offset
            if offset == self._pos:
                self._sha.update(data)
                self._pos += len(data)
            elif offset < self._pos < offset + len(data):  # overlaps the end of what was hashed
                self._sha.update(memoryview(data)[self._pos - offset:])
                self._pos = offset + len(data)

    def check(self) -> None:
        """Hash what was not read in order and compare; an error names the object that differs."""
        with self._lock:
            if not self._used:
                return
            while self._pos < self.size:
                chunk = self.read_range(self._pos, min(self.chunk, self.size - self._pos))
                if not chunk:
                    break
                self._sha.update(chunk)
                self._pos += len(chunk)
            if self._pos != self.size or self._sha.hexdigest() != self.expected:
                raise UpcyclerError(f"{self.label}: contents differ from the sha256 recorded in upcycler.json "
                                    "(corrupted or modified after it was written); re-copy or re-download it, "
                                    "or if you changed it on purpose, remove its entry from upcycler.json")
            self._used = False  # checked: a second check() is free


def file_watch(path: Path, size: int, sha: str) -> DigestWatch:
    """A watch over a whole file, reading skipped ranges with `os.pread`."""

    def read_range(offset: int, length: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    return DigestWatch(shown_path(path), size, sha, read_range, prefix_gap=_HEADER_LIMIT)
