"""Streaming writes of large files that keep the page cache small: write in slices, drop what is on disk.

A writer that produces tens of gigabytes fills the page cache with dirty pages, the kernel throttles it
while it writes them back, and every new page it dirties is a fresh page the kernel has to find, which
on a virtual machine is often a page the host has reclaimed and must fault in again. `StreamingFile`
avoids both: it writes in slices of `SLICE` bytes, and after every `WINDOW` bytes starts the window's
writeback (`sync_file_range`), waits for the oldest window once more than `IN_FLIGHT` are in flight, and
drops that one from the page cache (`posix_fadvise(DONTNEED)`), so at most about three windows of the
file are ever cached and the pages they free are reused for the next ones. `close()` fsyncs, as before.
On a platform without `sync_file_range` it is a plain unbuffered writer with the same bytes and fsync.

Measured on a 2-core VM writing 4 GiB from memory: 8.4 s plain, 1.6 s with the drop-behind.

`DropBehind` does the same for files another library writes (Orbax's tensorstore): after each batch it
starts the writeback of the files that changed and drops those of the batch before, once on disk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

SLICE = 8 << 20  # bytes per write(2) (and per digest task): large enough to amortise the call
WINDOW = 64 << 20  # bytes between two writeback steps
IN_FLIGHT = 2  # windows being written back while the next is filled: one left the disk idle between steps

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* (linux/fs.h)


def _sync_file_range():
    """libc's `sync_file_range(fd, offset, nbytes, flags)`, or None where there is none (not Linux)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_RANGE = _sync_file_range()


class StreamingFile:
    """A new file written front to back, unbuffered, whose written pages leave the page cache behind it.

    Preserves the bytes exactly: only how they reach the disk changes. `write` raises `OSError` as
    `os.write` does (a full disk); the caller removes the file.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.offset = 0
        self._flushed = 0  # writeback was started for [0, _flushed)
        self._dropped = 0  # [0, _dropped) is on disk and out of the page cache

    def write(self, data: bytes | memoryview) -> None:
        """Append all of `data`."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:done + SLICE])
        self.offset += done
        if _SYNC_RANGE is not None and self.offset - self._flushed >= WINDOW:
            self._writeback()

    def _writeback(self) -> None:
        """Start writing back what was written since the last step; wait for and drop the oldest window
        once more than `IN_FLIGHT` are being written back."""
        _SYNC_RANGE(self._fd, self._flushed, self.offset - self._flushed, _WRITE)
        self._flushed = self.offset
        if self._flushed - self._dropped > IN_FLIGHT * WINDOW:
            length = self._flushed - IN_FLIGHT * WINDOW - self._dropped
            _SYNC_RANGE(self._fd, self._dropped, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            os.posix_fadvise(self._fd, self._dropped, length, os.POSIX_FADV_DONTNEED)
            self._dropped += length

    def close(self) -> None:
        """Flush everything to disk (fsync) and close."""
        try:
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without flushing (the caller discards the file)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DropBehind:
    """Page-cache drop-behind for a directory whose files another writer produces in batches.

    Call `step()` after each batch: files that grew since the last step start writing back; those that
    started at the step before are waited for and dropped from the page cache. Only the cache changes,
    never the bytes; a file that disappears in between is skipped.
    """

    def __init__(self, root: Path):
        self.root = root
        self._sizes: dict[Path, int] = {}
        self._started: list[Path] = []

    def step(self) -> None:
        if _SYNC_RANGE is None:
            return
        grown = []
        for path in self.root.rglob("*"):
            try:
                size = path.stat().st_size if path.is_file() and not path.is_symlink() else None
            except OSError:
                continue
            if size is not None and size != self._sizes.get(path):
                self._sizes[path] = size
                grown.append(path)
        for path in self._started:
            self._flush(path, _WAIT_BEFORE | _WRITE | _WAIT_AFTER, drop=True)
        for path in grown:
            self._flush(path, _WRITE, drop=False)
        self._started = grown

    @staticmethod
    def _flush(path: Path, flags: int, *, drop: bool) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        try:
            _SYNC_RANGE(fd, 0, 0, flags)  # 0 bytes: to the end of the file
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
