"""Who holds a lock: the record a holder writes about itself, how it is shown, and whether it is gone.

Shared by the two kinds of lock (`upcycler.io.write_lock` on a disk, `upcycler.io.bucket_lease` in a
bucket): a holder's host, pid and start time, and the machine boot and pid namespace its pid belongs to,
so a lock whose holder ran on this machine and has ended can be taken over at once.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.untrusted import escape


class Busy(UpcyclerError):
    """Another process holds the lock; the message names it."""


class Lock:
    """A held lock. `check()` raises if it was lost meanwhile (only a bucket lease can be: one left
    unrenewed past its expiry and taken over)."""

    def check(self) -> None:
        return None


def holder_record(**extra: object) -> dict:
    """What a holder writes about itself: host, pid, since when (Unix time), and the machine boot and pid
    namespace its pid belongs to (`here`)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "here": here(), **extra}


def here() -> str:
    """This machine's boot and pid namespace: where a pid names one process (empty when unknown)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def holder_is_gone(record: dict) -> bool:
    """Whether the holder `record` names ran where this process runs (`here`) and has ended."""
    if not record.get("here") or record.get("here") != here() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def describe_holder(record: dict | None) -> str:
    """`host H, pid P, since 2026-01-02 03:04:05 UTC` for a holder's record (`holder record unreadable`
    for one that is not)."""
    if not isinstance(record, dict):
        return "holder unknown: its record is unreadable"
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record["since"])))
    except (KeyError, TypeError, ValueError, OverflowError):
        since = "an unknown time"
    host, pid = escape(str(record.get("host", "?")))[:80], escape(str(record.get("pid", "?")))[:20]
    return f"host {host}, pid {pid}, since {since}"
