"""What kind of location a user's path names: a local path, a URL (object storage, the Hub), or a Hub id.

Every path a user gives (a CLI argument, a path in a training config) is checked here before anything
opens it. Where a path must be local (the CLI's `LOCAL_PATH` arguments, the paths of a training config
or a recipe), a URL is refused in one line that says so and how to proceed, instead of being taken as a
relative local path (`gs://b/run` would otherwise become the local directory `gs:/b/run`, and a run would
train for hours onto a disk that disappears with the VM). Model sources and outputs of the CLI take
bucket URLs and Hub ids (`upcycler.cli.path_type`). A missing local path that looks like a Hub id
(`org/name`) gets a hint on how to fetch it. A gs:// URL must name a bucket (`bucket_and_key`), wherever it
is given.

Every location the tool builds from outside input (the key of a gs:// URL, an object name a bucket lists,
a glob's match, a Hub revision, the cache directory a remote source is copied into) goes through `within`:
a name with an empty, `.` or `..` segment is refused in one line, so nothing is ever read, written or
deleted outside the root the name was given under, and no object is written under such a name.

What this module preserves: a local path is returned unchanged (`Path(text)`); a location `within`
accepts is its root and name joined as given.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path, PurePath
from typing import NewType

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe, show_as

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")  # Cloud Storage's rule, less its IP and goog checks
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def url_scheme(text: str) -> str | None:
    """The scheme of `text` when it is a URL (`gs`, `s3`, `hf`, `https`, …), else None."""
    found = _URL.match(text)
    return found.group(1).lower() if found else None


def local_path(text: str | Path, what: str) -> Path:
    """`text` as a local path; a URL is refused naming `what` (the option or argument it was given as)."""
    if isinstance(text, Path):
        return text
    scheme = url_scheme(text)
    if scheme is not None:
        raise UpcyclerError(
            f"{what}: {describe(text)}: {scheme}:// locations are not supported here, only local paths; use a "
            f"local directory (fetch inputs with `gcloud storage cp -r` or `huggingface-cli download NAME "
            f"--local-dir DIR`, copy outputs afterwards)")
    return Path(text)


def bucket_and_key(url: str, what: str | None = None) -> tuple[str, str]:
    """`gs://bucket/a/b/` as `("bucket", "a/b")`; a URL that names no bucket (`gs://`, `gs:///a`) or a
    name Cloud Storage refuses is refused in one line, naming `what` (the option or config key) if given."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    problem = ("names no bucket" if not bucket else
               None if _BUCKET_NAME.match(bucket) else
               f"{describe(bucket)} is not a bucket name (3 to 222 lowercase letters, digits, '-', '_' and '.', "
               "first and last a letter or digit)")
    if problem:
        raise UpcyclerError(f"{what + ': ' if what else ''}{describe(url)}: {problem}; write gs://BUCKET/PATH")
    key = key.strip("/")
    if key:
        within(f"gs://{bucket}", key, named=f"{what + ': ' if what else ''}{describe(url, 200)}",
               fix="write gs://BUCKET/PATH with no '.', '..' or empty segment")
    return bucket, key


_NOT_A_NAME = {"": "an empty segment", ".": "a '.' segment", "..": "a '..' segment"}


def within(root: str, name: str, *, fix: str, named: str | None = None) -> str:
    """`root/name`: the place the relative `name` (from outside input: a URL's key, an object name a bucket
    lists, a glob's match, a Hub revision) names under `root` (a bucket URL, a local directory).

    Refused in one line, naming the location (`named`, else `root/name`) and `fix`, when `name` is empty or
    absolute, has an empty, `.` or `..` segment, or a NUL: once normalised it would leave `root`, or name
    another place than it says (an object store takes `a/../b` literally, a disk does not). What this
    preserves: an accepted name is joined to `root` unchanged."""
    root = root.rstrip("/") or root
    location = f"{root.rstrip('/')}/{name}"  # a root of "/" stays one slash
    segment = next((part for part in name.split("/") if part in _NOT_A_NAME), None)
    if segment is None and "\0" not in name:
        return location
    shown = named or describe(location, 200)
    normal = posixpath.normpath(name)
    if normal == ".." or normal.startswith("../"):
        raise UpcyclerError(f"{shown}: leaves {describe(root, 200)} ('..' segments); {fix}")
    kind = _NOT_A_NAME[segment] if segment is not None else "a NUL character"
    raise UpcyclerError(f"{shown}: has {kind}, so it names no one place under {describe(root, 200)}; {fix}")


Location = NewType("Location", Path)
"""The annotation of a config path that may name a bucket (`run_dir`): its value is a local `Path`, or an
`etils.epath.Path` for gs:// (which Orbax and the run directory's code use as they use a local path)."""


def location(text: str | PurePath, what: str) -> Path:
    """`text` as a `Location`: gs:// becomes a bucket path (with the clients configured,
    `upcycler.bucket_client`); any other URL is refused naming `what`; anything else is a local path."""
    if isinstance(text, PurePath):
        return text  # type: ignore[return-value]  (a Path, or a bucket path made earlier)
    if url_scheme(text) == "gs":
        from etils import epath

        from upcycler.bucket_client import configure

        bucket_and_key(text, what)
        configure()
        return epath.Path(text)
    return local_path(text, what)


def is_remote(path: PurePath | str) -> bool:
    """Whether `path` names a bucket (a `location` made it from gs://); a local path never does."""
    return str(path).startswith("gs://")


def hub_id_hint(path: Path) -> str:
    """For a missing `path` that reads as a Hub id (`org/name`, relative), a hint on fetching it; else ''."""
    text = str(path)
    if path.is_absolute() or not _HUB_ID.match(text) or text.startswith("."):
        return ""
    return (f" (if {text} is a Hugging Face Hub id: this path must be a local directory; "
            f"`huggingface-cli download {text} --local-dir DIR` fetches it)")


_ORIGINS: dict[str, str] = {}


def remember_origin(local: Path, origin: str) -> None:
    """Record, for this process, that the local directory `local` is a copy of the remote `origin`
    (a bucket mirror, a Hub snapshot), so that lineage and messages name the origin, not the cache."""
    _ORIGINS[str(local)] = origin
    show_as(local, origin)


def recorded_location(path: Path | str) -> str:
    """How a source is recorded in a manifest's lineage: its remote origin when it is a copy of one."""
    return _ORIGINS.get(str(path), str(path))
