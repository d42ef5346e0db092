"""One writer at a time per output and per run directory: an exclusive lock, refused rather than awaited.

`locked(lock, busy, fix)` holds the lock named `lock` for the block, or raises `Busy` at once: one line,
`busy (who holds it: host, pid, since when); fix`. `lock` is a local path or a bucket URL:

- Local: `flock` on the file `lock`, which holds its holder's host, pid and start time. The kernel drops
  the lock when the holder's process ends, however it ends (a SIGKILL, a crash), so the lock of a dead
  holder is simply taken over; its file is reused. The holder removes the file on release; a process that
  locked a file removed meanwhile looks again, so two processes never hold two files of the same name.
  (`flock` is honoured across processes of one host, and across NFS clients, which map it to POSIX locks;
  on a file system that has no locks at all, some FUSE mounts, writes go on unlocked, as they did before.)
- Bucket: a lease object created only where none exists (`upcycler.io.bucket_lease`).

Where locks live: an output's is `.NAME.lock` beside it (`output_lock`), so replacing the output never
touches it; a run directory's is inside it (`RUN_DIR_LOCK`), since the run directory itself stays.

What this guarantees: while a process holds a lock, every other process asking for it is refused; a
holder that is gone does not keep it (local: once its process ended; bucket: once its lease expired, or
at once when it ran on this machine and its process ended).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.io import bucket_lease
from upcycler.io.lock_holder import Busy, Lock, describe_holder, holder_record
from upcycler.untrusted import describe

__all__ = ["RUN_DIR_LOCK", "Busy", "Lock", "locked", "output_lock"]

RUN_DIR_LOCK = ".upcycler-lock"
"""The lock of a run directory, inside it."""
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}  # flock's "not on this file system"
_READ_TRIES = 20  # a holder writes its record just after locking: a reader looks again for up to ~1 s


def output_lock(out: Path | str) -> Path | str:
    """The lock of the output `out` (a local path or a bucket URL): `.NAME.lock` beside it."""
    if isinstance(out, str) and "://" in out:
        parent, _, name = out.rstrip("/").rpartition("/")
        if parent.endswith(":/"):  # a whole bucket: its lock is its top-level `.upcycler-lock`
            return f"{out.rstrip('/')}/{RUN_DIR_LOCK}"
        return f"{parent}/.{name}.lock"
    out = Path(out)
    return out.parent / f".{out.name}.lock"


@contextmanager
def locked(lock: Path | str, busy: str, fix: str, *, lease_seconds: float | None = None,
           wait_for_expiry: bool = False) -> Iterator[Lock]:
    """Hold the lock `lock` (a local path, or a bucket URL) for the block; when another process holds it,
    raise `Busy` at once: `busy (holder); fix`. A bucket lease: `lease_seconds` sets its length
    (`bucket_lease.LEASE_SECONDS` by default); with `wait_for_expiry`, one held elsewhere is watched until
    it would expire (one lease at most) and taken over if its holder did not renew it (a crashed run
    restarted on another host); one whose holder ran here and is gone is taken over at once."""
    if isinstance(lock, str) and "://" in lock:
        with bucket_lease.leased(lock, busy, fix, seconds=lease_seconds, wait_for_expiry=wait_for_expiry) as lease:
            yield lease
        return
    fd = _acquire(Path(lock), busy, fix)
    if fd is None:
        yield Lock()
        return
    try:
        yield Lock()
    finally:
        with suppress(OSError):
            os.unlink(lock)  # before unlocking: a process that opened this file then finds it gone
        os.close(fd)


def _acquire(path: Path, busy: str, fix: str) -> int | None:
    """The descriptor of `path`, locked by this process and holding its record (None where the lock file
    cannot be created); `Busy` if another process holds it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:  # a place this process cannot write: neither can any write of it, whose own check
            return None  # refuses it naming the option and the fix (and no other writer can race it there)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(f"{busy} ({describe_holder(_read_record(path))}); {fix}") from None
        except OSError as err:
            if err.errno in _NO_LOCKS:  # a file system without locks (some FUSE mounts): as before locks
                return fd
            os.close(fd)
            raise UpcyclerError(f"{describe(str(path), 200)}: cannot lock it ({err.strerror}); use a file system "
                                "that supports file locks") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_ino, current.st_dev) == (mine.st_ino, mine.st_dev):
            data = json.dumps(holder_record()).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return fd
        os.close(fd)  # its holder released and removed it between our open and our lock: again


def _read_record(path: Path) -> dict | None:
    """The record in the lock file `path`, looked at again briefly while its holder is still writing it."""
    for _ in range(_READ_TRIES):
        try:
            record = json.loads(path.read_bytes())
            if isinstance(record, dict):
                return record
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None
