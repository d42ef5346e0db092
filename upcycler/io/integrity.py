"""Check what is read from a checkpoint against the digests its manifest (`upcycler.json`) records.

An upcycler output records the sha256 of every file (HF) or of every tensor's C-order bytes (Orbax), and
an HF output the xxh3-128 of every tensor's bytes too. When a source has such a manifest, readers hand
each byte range they read to a `DigestWatch` (an HF source: one per tensor where the manifest has
tensor digests, so a source read in part is checked on the tensors read, not on whole files), which
hashes it on the fly; a range that skips ahead first has the skipped bytes read and hashed, there and
then, on the reader's thread (so that work overlaps the writing instead of following it), and a range
already hashed is passed over. A watch over one tensor of an Orbax checkpoint leaves skipped rows to
`check` instead (`ahead=False`), so reading expert e alone reads only expert e. `Checkpoint.check_inputs()` completes every watch and compares;
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

import xxhash

from upcycler.errors import UpcyclerError
from upcycler.untrusted import shown_path

_CHUNK = 8 * 1024 * 1024

ReadRange = Callable[[int, int], bytes]  # (offset, length) -> bytes, straight from the stored object


@dataclass
class DigestWatch:
    """The digest (sha256, or xxh3_128) of one stored object (a file, or one tensor's bytes), accumulated
    from what is read."""

    label: str  # what to name in an error: the file, or "file: tensor"
    size: int
    expected: str
    read_range: ReadRange
    chunk: int = _CHUNK  # how much is asked of `read_range` at a time
    ahead: bool = True  # hash skipped bytes when a later range arrives (else: left for `check`)
    algorithm: str = "sha256"  # or "xxh3_128"
    _pos: int = 0
    _used: bool = False

    def __post_init__(self) -> None:
        self._sha = xxhash.xxh3_128() if self.algorithm == "xxh3_128" else hashlib.sha256()
        self._lock = threading.Lock()

    def touch(self) -> None:
        """Mark the whole object as read (a file copied or parsed whole): `check` hashes it from disk."""
        with self._lock:
            self._used = True

    def saw(self, offset: int, data: bytes | memoryview) -> None:
        """`data` was read at `offset`: hash what lies between the bytes hashed so far and it (read from the
        stored object; with `ahead` only), then whatever part of `data` is new. The bytes hashed are always
        a prefix."""
        with self._lock:
            self._used = True
            if self.ahead:
                self._hash_until(offset)
            if offset == self._pos:
                self._sha.update(data)
                self._pos += len(data)
            elif offset < self._pos < offset + len(data):  # overlaps the end of what was hashed
                self._sha.update(memoryview(data)[self._pos - offset:])
                self._pos = offset + len(data)

    def _hash_until(self, end: int) -> None:
        """Read and hash the stored bytes from the hashed prefix's end to `end` (at most the object's size)."""
        end = min(end, self.size)
        while self._pos < end:
            chunk = self.read_range(self._pos, min(self.chunk, end - self._pos))
            if not chunk:
                break
            self._sha.update(chunk)
            self._pos += len(chunk)

    def check(self) -> None:
        """Hash what was not read in order and compare; an error names the object that differs."""
        with self._lock:
            if not self._used:
                return
            self._hash_until(self.size)
            if self._pos != self.size or self._sha.hexdigest() != self.expected:
                raise UpcyclerError(f"{self.label}: contents differ from the {self.algorithm} recorded in upcycler.json "
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

    return DigestWatch(shown_path(path), size, sha, read_range)


def tensor_watch(path: Path, name: str, start: int, size: int, digest: str) -> DigestWatch:
    """A watch over one tensor's bytes (`size` at `start` of the file `path`), by its xxh3-128; offsets it
    is shown are the tensor's own. Skipped rows are left for `check`, which reads only this tensor."""

    def read_range(offset: int, length: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, length, start + offset)
        finally:
            os.close(fd)

    return DigestWatch(f"{shown_path(path)}: tensor {name}", size, digest, read_range, ahead=False,
                       algorithm="xxh3_128")
