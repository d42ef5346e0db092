"""A lock in a bucket: a lease object created only where none exists, renewed by its holder, and taken
over once it has expired.

Cloud Storage has no locks, but it has preconditions: a write with `ifGenerationMatch=0` succeeds only if
the object does not exist, and one with `ifGenerationMatch=G` only if the object is still generation G.
So:

- acquire: create the lease object with `ifGenerationMatch=0`. Its metadata (read with its generation in
  one request) names the holder (host, pid, since when) and when the lease expires (`seconds` after the
  last renewal, by the holder's clock: hosts' clocks must agree to well within `seconds`);
- a second process finds it there: refused (`lock_holder.Busy`, naming the holder) while the lease runs;
  once it has expired (its holder crashed, or stopped renewing), or at once when its holder ran on this
  machine (same boot, same pid namespace) and its process is gone, rewritten with `ifGenerationMatch=G`:
  of several processes taking it over, exactly one wins, the others see the new holder. A run restarted
  after a crash may wait for the lease to expire instead of being refused (`wait_for_expiry`);
- the holder renews it every `seconds / 3` from a thread (again `ifGenerationMatch=G`, its own last
  generation). A renewal refused means another process took the lease over: the lease is lost, and
  `check()`, called before a commit, raises instead of committing;
- release: the holder deletes its own generation (`ifGenerationMatch`).

What this guarantees: at most one live holder at a time; a crashed holder keeps the lease at most
`seconds`.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io import object_store as store
from upcycler.io.lock_holder import Busy, Lock, describe_holder, holder_is_gone, holder_record
from upcycler.locations import bucket_and_key
from upcycler.untrusted import describe

LEASE_SECONDS = 60.0
"""How long a lease lasts without renewal; the holder renews it every third of that."""
_TAKEOVER_TRIES = 5  # rounds of create / look / take over before giving up on a lease that keeps changing


class Lease(Lock):
    """The lease on the object `url`, held by this process (see the module docstring)."""

    def __init__(self, url: str, busy: str, fix: str, seconds: float):
        self.url, self.busy, self.fix, self.seconds = url, busy, fix, seconds
        self.record = holder_record(token=secrets.token_hex(8))
        self.generation: str | None = None
        self.lost: str | None = None
        self._renewed = self._stamp = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, wait_for_expiry: bool = False) -> None:
        """Create the lease, or take over an expired one (or one whose holder ran here and is gone);
        `Busy` when another process holds it. With `wait_for_expiry`, a lease held elsewhere is watched
        until it would expire (`seconds` at most), and taken over unless its holder renewed it."""
        for _ in range(_TAKEOVER_TRIES):
            try:
                self.generation = _write(self.url, self._stamped(), "0")
                break
            except FileExistsError:
                pass
            current = _read(self.url)
            if current is None:
                continue  # released meanwhile: create it again
            generation, record = current
            if record.get("token") == self.record["token"]:  # our own create, answered late and retried
                self.generation = generation
                break
            if _expires(record) > time.time() and not holder_is_gone(record):
                if not wait_for_expiry or not self._unrenewed(generation, record):
                    raise Busy(f"{self.busy} ({describe_holder(record)}); {self.fix}")
                wait_for_expiry = False  # its holder let it expire: look again, and take it over
                continue
            with suppress(FileExistsError):  # expired: take it over, unless another process did first
                self.generation = _write(self.url, self._stamped(), generation)
                break
        else:
            raise Busy(f"{self.busy} (its lock {describe(self.url, 200)} keeps changing hands); {self.fix}")
        self._renewed = self._stamp
        self._thread = threading.Thread(target=self._renew, name="upcycler-lease", daemon=True)
        self._thread.start()

    def _unrenewed(self, generation: str, record: dict) -> bool:
        """Watch the lease `generation` (holding `record`) until it would expire (`seconds` at most):
        False as soon as it is renewed or taken over (a live holder), True once it expired as it was or
        was released."""
        until = time.time() + max(0.0, min(_expires(record) - time.time(), self.seconds)) + 0.5
        while True:
            time.sleep(max(0.0, min(until - time.time(), self.seconds / 6, 1.0)))
            current = _read(self.url)
            if current is None:
                return True
            if current[0] != generation:
                return False
            if time.time() >= until:
                return True

    def _stamped(self) -> dict:
        self._stamp = time.time()  # the lease runs `seconds` from here, once the write is accepted
        return {**self.record, "expires": self._stamp + self.seconds}

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3) and self.renew():
            pass

    def renew(self) -> bool:
        """Extend the lease by `seconds` from now; returns whether it is still held (else `lost` says why)."""
        try:
            self.generation = _write(self.url, self._stamped(), self.generation or "0")
            self._renewed = self._stamp
        except FileExistsError:
            try:
                current = _read(self.url)
            except UpcyclerError:
                current = None
            self.lost = f"taken over by {describe_holder(current[1])}" if current else "deleted by another process"
        except UpcyclerError as err:  # unanswered: tried again at the next renewal while the lease still runs
            if time.time() > self._renewed + self.seconds:
                self.lost = f"not renewed before it expired ({describe(str(err), 160)})"
        return self.lost is None

    def check(self) -> None:
        if self.lost:
            raise UpcyclerError(f"{describe(self.url, 200)}: this process lost its lock ({self.lost}); nothing was "
                                "committed; rerun once the other writer is done")

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost or self.generation is None:
            return
        bucket, key = bucket_and_key(self.url)
        with suppress(FileNotFoundError, FileExistsError, UpcyclerError), store._errors(self.url, "releasing the lock"):
            store.filesystem().call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=self.generation)


@contextmanager
def leased(url: str, busy: str, fix: str, *, seconds: float | None = None,
           wait_for_expiry: bool = False) -> Iterator[Lease]:
    """Hold the lease on the object `url` for the block (see the module docstring and `Lease.acquire`);
    `Busy` is raised with `busy (holder); fix`."""
    lease = Lease(url, busy, fix, LEASE_SECONDS if seconds is None else seconds)
    lease.acquire(wait_for_expiry)
    try:
        yield lease
    finally:
        lease.release()


def _expires(record: dict) -> float:
    try:
        return float(record["expires"])
    except (KeyError, TypeError, ValueError):
        return 0.0  # a record without a readable expiry protects nothing


def _write(url: str, record: dict, if_generation_match: str) -> str:
    """Write the lease object `url` holding `record` (as its metadata and its bytes) only if its generation is
    `if_generation_match` ("0": only if it does not exist); returns the new generation. A refused
    precondition raises `FileExistsError`."""
    bucket, key = bucket_and_key(url)
    fs = store.filesystem()
    meta = json.dumps({"name": key, "contentType": "application/json",
                       "metadata": {"lease": json.dumps(record)}})
    body = (b"--==0==\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n" + meta.encode()
            + b"\r\n--==0==\r\nContent-Type: application/json\r\n\r\n" + json.dumps(record).encode()
            + b"\r\n--==0==--")
    try:
        with store._errors(url, "writing the lock"):
            answer = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{{}}/o", bucket, uploadType="multipart",
                             headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body,
                             json_out=True, ifGenerationMatch=str(if_generation_match))
    except UpcyclerError as err:
        if isinstance(err.__cause__, FileExistsError):  # gcsfs's word for 412 Precondition Failed
            raise FileExistsError(url) from None
        raise
    return str(answer["generation"])


def _read(url: str) -> tuple[str, dict[str, Any]] | None:
    """The lease object's generation and record (one request: its metadata), or None when there is none."""
    bucket, key = bucket_and_key(url)
    try:
        with store._errors(url, "reading the lock"):
            info = store.filesystem().call("GET", "b/{}/o/{}", bucket, key, json_out=True)
    except UpcyclerError as err:
        if isinstance(err.__cause__, FileNotFoundError):
            return None
        raise
    try:
        record = json.loads((info.get("metadata") or {}).get("lease", ""))
    except ValueError:
        record = None
    return str(info.get("generation", "")), record if isinstance(record, dict) else {}
