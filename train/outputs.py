"""How `prepare-data` and `report` write: files made in a hidden staging directory, moved into OUT only
when every one of them is complete.

What it preserves: OUT and the files already in it are untouched while the work runs; a failure or an
interrupt removes the staging directory (and any parent directory it had to create), so nothing
finished-looking is left behind. A new OUT appears in one rename; into an existing OUT the files are
moved one by one, `markers` last (a marker, like `NAME.meta.json`, says its set is complete: its old
version is removed before anything is replaced, the new one moved in after the rest).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.untrusted import shown_path


@contextmanager
def staged_files(
    out: Path, option: str, is_marker: Callable[[str], bool] = lambda name: False
) -> Iterator[Path]:
    """An empty hidden directory to write into; its files land in `out` (a directory) if the block succeeds.

    `option` names the flag that chose `out` in messages (`--out`). Every refusal (OUT is a file, its
    parent cannot be written) happens on entry, before the caller does any work.
    """
    if out.exists() and not out.is_dir():
        raise UpcyclerError(f"{shown_path(out)}: exists and is not a directory; choose another {option}")
    existed = out.is_dir()
    created = [] if existed else _make_parents(out.parent, option)
    tag = f"partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stage = out / f".{tag}" if existed else out.parent / f".{out.name}.{tag}"
    try:
        try:
            stage.mkdir()
        except OSError as err:
            raise UpcyclerError(
                f"{shown_path(out if existed else out.parent)}: cannot write here ({err.strerror}); "
                f"choose a writable {option}"
            ) from None
        yield stage
        _publish(stage, out, is_marker, option)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for directory in reversed(created):
            with suppress(OSError):
                directory.rmdir()
        raise


def _make_parents(directory: Path, option: str) -> list[Path]:
    """Create `directory` and its missing parents (like `mkdir -p`); returns those created, outermost
    first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    if not directory.is_dir():
        raise UpcyclerError(f"{shown_path(directory)}: is a file, not a directory; choose another {option}")
    created = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except OSError as err:
            for done in reversed(created):
                with suppress(OSError):
                    done.rmdir()
            raise UpcyclerError(
                f"{shown_path(path)}: cannot create it ({err.strerror}); choose a writable {option}"
            ) from None
        created.append(path)
    return created


def _publish(stage: Path, out: Path, is_marker: Callable[[str], bool], option: str) -> None:
    """Move the staged files into `out`: one rename for a new `out`, else file by file, markers last."""
    try:
        if not out.exists():
            os.rename(stage, out)
            return
        names = sorted(os.listdir(stage), key=lambda name: (is_marker(name), name))
        for name in names:
            if is_marker(name):
                (out / name).unlink(missing_ok=True)
        for name in names:
            os.replace(stage / name, out / name)
        stage.rmdir()
    except OSError as err:
        why = "disk full" if err.errno == errno.ENOSPC else f"cannot write ({err.strerror})"
        raise UpcyclerError(f"{shown_path(out)}: {why}; free space or choose another {option}") from None
