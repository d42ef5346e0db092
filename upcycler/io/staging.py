"""Where outputs are born: a hidden temporary sibling, renamed into place only when complete.

The rules every writing command obeys (HF and Orbax checkpoints, merges, recipes, prepared data):

- OUT is never a source: it may not be, contain, or lie inside a directory the write reads from
  (compared after resolving symlinks).
- An existing OUT is replaced only with `--overwrite`, and only when it is an empty directory or a
  directory a previous upcycler write produced (it holds `upcycler.json`). Anything else is refused,
  naming it, so `--overwrite` can never delete a directory of unrelated files.
- The work happens in `.OUT.partial-<pid>-<random>` beside OUT; a replaced OUT is first renamed to
  `.OUT.old-<pid>-<random>` and then removed. A write that is killed leaves such directories behind;
  the next write to the same OUT removes those whose writer process is gone (`reclaim_leftovers`).
- Commands that add files to a directory (prepare-data, report) stage them in `OUT/.partial-<pid>-…`
  (or beside a new OUT) and move them in only when all are complete (`staged_files`).
- One writer at a time: a write holds OUT's lock (`.OUT.lock` beside it, `upcycler.io.write_lock`) from
  its first check to its final rename, so a second write to the same OUT is refused at once, naming the
  first (`--overwrite` included: it never replaces an output another process is writing). The final
  rename checks again, under the lock, that an OUT found there may be replaced (only with `--overwrite`).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.io.manifest import MANIFEST
from upcycler.io.write_lock import Lock, locked, output_lock
from upcycler.untrusted import shown_path

_PARTIAL = "partial"
_OLD = "old"


def overlap(out: Path, source: Path) -> str | None:
    """How `out` overlaps `source` ("is", "contains", "lies inside"), after resolving symlinks; or None."""
    target, real = Path(os.path.realpath(out)), Path(os.path.realpath(source))
    if real == target:
        return "is"
    if target in real.parents:
        return "contains"
    if real in target.parents:
        return "lies inside"
    return None


def refuse_overlap(out: Path, sources: Iterable[Path], *, option: str = "OUT") -> None:
    """Refuse an output that is a source, contains one, or lies inside one (after resolving symlinks)."""
    for source in sources:
        how = overlap(out, source)
        if how:
            raise UpcyclerError(f"{shown_path(out)}: {how} the source {shown_path(source)}; choose an {option} "
                                "outside every input")


def check_replaceable(out: Path) -> None:
    """Refuse to replace `out` unless it is an empty directory or an earlier upcycler output."""
    if out.is_symlink() or not out.is_dir():
        kind = "a symlink" if out.is_symlink() else "a file"
        raise UpcyclerError(f"{shown_path(out)}: is {kind}, not an upcycler output; --overwrite only replaces "
                            "directories upcycler wrote; remove it yourself or choose another output")
    try:
        empty = next(os.scandir(out), None) is None
    except OSError as err:
        raise UpcyclerError(f"{shown_path(out)}: cannot list it ({err.strerror}); choose another output") from None
    if not empty and not (out / MANIFEST).is_file():
        raise UpcyclerError(f"{shown_path(out)}: holds files upcycler did not write (no {MANIFEST}); "
                            "--overwrite only replaces earlier upcycler outputs; remove it yourself or "
                            "choose another output")


def check_output(out: Path, *, overwrite: bool, sources: Iterable[Path] = ()) -> None:
    """Refuse `out` if it overlaps a source or exists and may not be replaced; changes nothing."""
    refuse_overlap(out, sources)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise UpcyclerError(f"{shown_path(out)}: already exists; choose another output or pass --overwrite")
        check_replaceable(out)


def prepare_output(out: Path, *, overwrite: bool, sources: Iterable[Path] = ()) -> None:
    """Every check that can refuse `out`, made before any work: overlap, existence, parent writable.

    Missing parent directories are created (like `mkdir -p`); a parent that is a file is refused.
    """
    check_output(out, overwrite=overwrite, sources=sources)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UpcyclerError(f"{shown_path(parent)}: is a file, not a directory; choose another output path") from None
    except OSError as err:
        raise UpcyclerError(f"{shown_path(parent)}: cannot create the output's directory ({err.strerror}); "
                            "choose an output directory you can write to") from None
    if not parent.is_dir():
        raise UpcyclerError(f"{shown_path(parent)}: is a file, not a directory; choose another output path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UpcyclerError(f"{shown_path(parent)}: not writable; choose an output directory you can write to")


def _tag(kind: str) -> str:
    """`kind-<pid>-<random>`: whose a temporary directory is, so leftovers of dead writers can be found."""
    return f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _sibling(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{_tag(kind)}"


def _writer_alive(name: str, prefix: str) -> bool:
    """Whether the process that named a leftover `prefix<pid>-<random>` still runs (unknown: assume yes)."""
    pid_text = name[len(prefix):].split("-", 1)[0]
    if not pid_text.isdigit():
        return False  # written before leftovers carried their writer's pid: nobody can still own it
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def reclaim_leftovers(out: Path) -> list[Path]:
    """Remove the temporary siblings of `out` left by writes whose process is gone; return them."""
    removed = []
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return removed
    for entry in entries:
        for kind in (_PARTIAL, _OLD):
            prefix = f".{out.name}.{kind}-"
            if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False) \
                    and not _writer_alive(entry.name, prefix):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    return removed


@contextmanager
def staged_directory(out: Path, *, overwrite: bool, sources: Iterable[Path] = ()) -> Iterator[Path]:
    """A temporary sibling of `out` that becomes `out` only if the block finishes without error.

    On any error (a full disk included) the sibling is removed; an existing `out` is untouched until
    the new one is complete, and with `overwrite` nothing of the old one is left behind.
    """
    prepare_output(out, overwrite=overwrite, sources=sources)
    with output_locked(out):
        check_output(out, overwrite=overwrite, sources=sources)  # it may have been finished just before the lock
        reclaim_leftovers(out)
        tmp = _sibling(out, _PARTIAL)
        try:
            tmp.mkdir()
        except OSError as err:
            raise UpcyclerError(f"{shown_path(out.parent)}: not writable ({err.strerror}); "
                                "choose an output directory you can write to") from None
        yield from _filled_then_renamed(tmp, out, overwrite)


def output_locked(out: Path) -> AbstractContextManager[Lock]:
    """Hold the lock of the output `out` (`upcycler.io.write_lock`); refused naming the process writing it."""
    return locked(output_lock(out), f"{shown_path(out)}: being written by another upcycler process",
                  "wait for it to finish or choose another output")


def _filled_then_renamed(tmp: Path, out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield `tmp` to be filled, then rename it to `out` (replacing an earlier output only with `overwrite`);
    remove it on any error."""
    try:
        yield tmp
        if out.exists() or out.is_symlink():  # it may have appeared or changed while we were writing
            if not overwrite:
                raise UpcyclerError(f"{shown_path(out)}: appeared while this command wrote it; choose another "
                                    "output or pass --overwrite")
            check_replaceable(out)
            trash = _sibling(out, _OLD)
            out.rename(trash)
            tmp.rename(out)
            _remove(trash)
        else:
            tmp.rename(out)
    except OSError as err:
        _discard(tmp)
        if err.errno == errno.ENOSPC:
            raise UpcyclerError(f"{shown_path(out)}: disk full while writing; free space or write elsewhere") from None
        raise UpcyclerError(f"{shown_path(out)}: cannot write ({err.strerror}); check the output location") from None
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: Path, attempts: int = 20) -> None:
    """Remove an unfinished output; retried briefly, because a failed save's background writes (Orbax)
    may still create files in it for a moment after the failure was reported."""
    for _ in range(attempts):
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            return
        time.sleep(0.1)


def _remove(path: Path) -> None:
    """Delete a replaced output completely (read-only files and directories included)."""

    def make_writable_and_retry(function, name, _exc) -> None:
        parent = os.path.dirname(name)
        for target in (parent, name):
            try:
                os.chmod(target, 0o700)
            except OSError:
                pass
        try:
            function(name)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _reclaim_inside(out: Path) -> None:
    """Remove `OUT/.partial-<pid>-…` staging directories of `staged_files` writers that are gone."""
    prefix = f".{_PARTIAL}-"
    try:
        entries = list(os.scandir(out))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False) \
                and not _writer_alive(entry.name, prefix):
            shutil.rmtree(entry.path, ignore_errors=True)


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
    if out.is_symlink() and not out.exists():
        raise UpcyclerError(f"{shown_path(out)}: a symlink that leads nowhere (dangling, or a loop); remove it "
                            f"or choose another {option}")
    existed = out.is_dir()
    created = [] if existed else make_parents(out.parent, option)
    stage = out / f".{_tag(_PARTIAL)}" if existed else _sibling(out, _PARTIAL)
    try:
        with output_locked(out):
            reclaim_leftovers(out)
            if existed:
                _reclaim_inside(out)
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


def make_parents(directory: Path, option: str) -> list[Path]:
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
        for name in names:  # refused before anything moves: a partial set would look finished
            if (out / name).is_dir() and not (out / name).is_symlink():
                raise UpcyclerError(f"{shown_path(out / name)}: is a directory, where this writes a file; "
                                    f"remove it or choose another {option}")
        for name in names:
            if is_marker(name):
                (out / name).unlink(missing_ok=True)
        for name in names:
            os.replace(stage / name, out / name)
        stage.rmdir()
    except OSError as err:
        why = "disk full" if err.errno == errno.ENOSPC else f"cannot write ({err.strerror})"
        raise UpcyclerError(f"{shown_path(out)}: {why}; free space or choose another {option}") from None
