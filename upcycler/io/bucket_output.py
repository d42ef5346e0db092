"""Outputs in a bucket: written in full on a local disk first, then published with a commit protocol.

Object stores have no rename, so the local rule (work in a hidden sibling, rename into place) becomes:

1. `OUT/.upcycler-writing` is written first: from then on OUT is an unfinished write;
2. what was at OUT before (an earlier upcycler output being replaced, or a killed write's leftovers) is
   deleted, then every file of the local output is uploaded (several at a time), `upcycler.json` (the
   manifest) alone after all of them;
3. `.upcycler-writing` is deleted: this is the commit. A write killed at any point before it leaves the
   marker, so no reader takes the output as finished (`refuse_unfinished`), and the next write to OUT
   cleans it up without `--overwrite`.

OUT is a gs:// URL whose key has no `.`, `..` or empty segment (`upcycler.locations.within`, checked
where the URL is given), and an OUT that holds an object with such a name is refused before anything is
written: no object is ever written or deleted under such a name. The rules of local outputs hold: OUT is
never a source (nor inside or around one), and an existing OUT is replaced only with `--overwrite` and
only when it is an earlier upcycler output (it holds `upcycler.json`).
Outputs that add files to a directory (`prepare-data --out`: one source's token file and metadata beside
the sources prepared before) use `add_files` instead: the new files are uploaded beside what is there,
each source's marker (its metadata, which readers look for) after its other files, so a killed upload
leaves no source that reads as prepared.

What this module preserves: the published objects are the local output's files, byte for byte, under
the same relative names.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.io import object_store as store
from upcycler.io import write_lock
from upcycler.io.manifest import MANIFEST
from upcycler.io.write_lock import Lock
from upcycler.locations import within
from upcycler.untrusted import describe

WRITING = ".upcycler-writing"
"""The marker of an unfinished write: written before anything else, deleted last (the commit)."""


def _within(url: str, other: str) -> bool:
    return url.rstrip("/") == other.rstrip("/") or url.startswith(other.rstrip("/") + "/")


def refuse_overlap(out: str, sources: Iterable[str | os.PathLike]) -> None:
    """Refuse an output URL that is, contains or lies inside a source URL."""
    for source in sources:
        if not isinstance(source, str) or not store.is_bucket_url(source):
            continue
        how = ("is" if out.rstrip("/") == source.rstrip("/") else "contains" if _within(source, out)
               else "lies inside" if _within(out, source) else None)
        if how:
            raise UpcyclerError(f"{describe(out, 200)}: {how} the source {describe(source, 200)}; choose an OUT "
                                "outside every input")


def check_output(out: str, *, overwrite: bool, sources: Iterable[str | os.PathLike] = ()) -> None:
    """Every check that can refuse the bucket output `out`, made before any work; changes nothing."""
    refuse_overlap(out, sources)
    existing = store.list_objects(out)
    for name in existing:  # never deleted nor replaced: an object store takes `a/../b` literally
        within(out, name, fix="delete that object yourself or choose another output")
    if not existing or WRITING in existing:
        return  # empty, or the leftovers of a killed write: replaced without --overwrite
    if not overwrite:
        raise UpcyclerError(f"{describe(out, 200)}: already exists; choose another output or pass --overwrite")
    if MANIFEST not in existing:
        raise UpcyclerError(f"{describe(out, 200)}: holds objects upcycler did not write (no {MANIFEST}); "
                            "--overwrite only replaces earlier upcycler outputs; delete them yourself or choose "
                            "another output")


def refuse_unfinished(url: str, objects: Iterable[str]) -> None:
    """Refuse to read `url` while it holds the marker of an unfinished write."""
    if WRITING in objects:
        raise UpcyclerError(f"{describe(url, 200)}: an unfinished upcycler write (it holds {WRITING}: the "
                            "write was killed or is still running); rerun the command that writes it")


def locked(out: str) -> AbstractContextManager[Lock]:
    """Hold the lock of the bucket output `out` (a lease beside it, `upcycler.io.bucket_lease`) for the
    block; refused at once, naming the holder, while another process writes `out`."""
    return write_lock.locked(write_lock.output_lock(out), f"{describe(out, 200)}: being written by another "
                             "upcycler process", "wait for it to finish or choose another output")


def publish(local: Path, out: str, *, lock: Lock | None = None) -> list[str]:
    """Upload the finished local output directory `local` to `out` with the commit protocol above.

    Returns the relative names published. `check_output` must have accepted `out` first. With `lock`
    (`locked`), the upload starts and the commit is made only while this process still holds it.
    """
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    if MANIFEST in names:  # the manifest goes last: an output without it is not an upcycler output
        names.remove(MANIFEST)
        names.append(MANIFEST)
    if lock is not None:
        lock.check()
    marker = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
    store.write_bytes(store.join(out, WRITING), marker.encode())
    stale = [store.join(out, name) for name in store.list_objects(out) if name != WRITING]
    store.remove(stale)
    last = [MANIFEST] if MANIFEST in names else []
    store.upload_all([(local / n, store.join(out, n)) for n in names if n not in last])  # side by side
    store.upload_all([(local / n, store.join(out, n)) for n in last])
    if lock is not None:
        lock.check()
    store.remove([store.join(out, WRITING)])
    return names


def refuse_existing(out: str, names: Iterable[str], *, overwrite: bool) -> None:
    """Refuse to add files to the bucket directory `out` over objects of the same names, unless `overwrite`."""
    existing = store.list_objects(out)
    taken = [name for name in names if name in existing]
    if taken and not overwrite:
        raise UpcyclerError(f"{describe(store.join(out, taken[0]), 200)}: already exists; choose another --out or "
                            "pass --overwrite")


def add_files(local: Path, out: str, *, is_marker: Callable[[str], bool]) -> list[str]:
    """Upload every file of the local directory `local` into the bucket directory `out`, beside the objects
    there; the files `is_marker` selects go last. Returns the relative names uploaded."""
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    ordered = [n for n in names if not is_marker(n)] + [n for n in names if is_marker(n)]
    for group in ([n for n in ordered if not is_marker(n)], [n for n in ordered if is_marker(n)]):
        store.upload_all([(local / n, store.join(out, n)) for n in group])
    return ordered
