"""Publishing an output directory to the Hugging Face Hub: check it, then upload it with a model card.

- `validate_for_upload` proves a directory is complete and safe to publish before anything touches the
  network. Every file to upload must be a regular file inside the directory: a symlink whose target
  leaves it (to `/etc/passwd`, to a sibling directory), a dangling symlink, a symlinked subdirectory,
  a pipe, device or socket is refused, naming the entry. A symlink to a regular file that stays inside
  the directory is uploaded with that file's bytes. Hidden entries (but `.gitattributes`) are skipped and
  never read. Then `config.json` parses, the shard index names only shards that are there, and every file
  the manifest `upcycler.json` lists has the recorded size and sha256 (hashed in a stream). The manifest
  and the index are read through `upcycler.untrusted` (size-capped, nesting bounded).
- `push` creates the repo (and branch), then uploads the checked files plus the model card of
  `upcycler.model_card` (only when the directory has no README.md) from a temporary staging directory of
  links, so the user's directory is never changed. Weight files of an earlier push that this one does not
  replace are deleted in the same commit. Hub failures become one-line `UpcyclerError`s with the token
  scrubbed; re-running resumes an upload.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.io.hashing import sha256_file
from upcycler.io.hf_read import INDEX, SINGLE, plain_member, read_json
from upcycler.io.manifest import MANIFEST, REWRITE, Manifest
from upcycler.io.manifest import read_manifest as read_manifest_of
from upcycler.units import human_bytes
from upcycler.untrusted import describe, load_json_object, shown_path

Echo = Callable[[str], None]

CONFIG = "config.json"
SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
STALE_WEIGHTS = [SINGLE, "model-*-of-*.safetensors", INDEX]
RETRY = "run the same command again: a retry resumes and skips files already uploaded"


# --- validation --------------------------------------------------------------------------------------


def validate_for_upload(directory: str | os.PathLike[str], *, echo: Echo | None = None) -> list[str]:
    """Check `directory` is a complete, uncorrupted upcycler output; return the files to upload (sorted)."""
    root = Path(directory)
    if not root.is_dir():
        raise UpcyclerError(f"{shown_path(root)}: not a directory; pass the output directory upcycler wrote")
    files = _list_files(root)
    for name in (CONFIG, MANIFEST):
        if name not in files:
            raise UpcyclerError(f"{shown_path(root / name)}: missing; {REWRITE}")
    read_json(root / CONFIG, REWRITE)
    manifest = read_manifest(root)
    _check_weights(root, files)
    _check_manifest_files(root, manifest, files, echo or (lambda _: None))
    return files


def read_manifest(root: Path) -> Manifest:
    """The manifest `upcycler.json` (read bounded), with its `files` table checked record by record."""
    manifest = read_manifest_of(root, fix=REWRITE)
    manifest.file_records()
    return manifest


def upload_source(root: Path, name: str) -> Path:
    """The real path of the regular file `root/name`, which must not leave `root` through a symlink.

    Refused, naming the entry: a symlink whose target is outside `root` or missing, a directory, and a
    pipe, device or socket (checked with `stat`, never opened, so nothing blocks). A symlink that stays
    inside `root` is allowed (its target's bytes are what gets uploaded).
    """
    path = root / name
    top = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    copy = f"copy the file into {shown_path(root)}"
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        if not path.is_symlink():
            raise UpcyclerError(f"{shown_path(path)}: missing; {REWRITE}") from None
        raise UpcyclerError(f"{shown_path(path)}: a symlink to {shown_path(real)}, which does not exist; "
                            f"delete the link or {copy}") from None
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot read ({err.strerror}); "
                            "check its permissions") from None
    if not real.is_relative_to(top):
        raise UpcyclerError(f"{shown_path(path)}: a symlink to {shown_path(real)}, outside the directory; "
                            f"only files inside it are uploaded: {copy}")
    if stat.S_ISDIR(mode):
        raise UpcyclerError(f"{shown_path(path)}: a directory where a file is expected; {REWRITE}")
    if not stat.S_ISREG(mode):
        raise UpcyclerError(f"{shown_path(path)}: not a regular file (a pipe, device or socket); "
                            f"delete it or {copy}")
    return real


def _list_files(root: Path) -> list[str]:
    """Every file to upload under `root` as a POSIX relative path, each checked by `upload_source`.

    Hidden entries are skipped (but not `.gitattributes`); a symlinked subdirectory is refused, wherever
    it points (its files would otherwise be silently left out, or read from outside `root`).
    """

    def unlistable(err: OSError) -> None:
        raise UpcyclerError(f"{shown_path(err.filename or root)}: cannot list ({err.strerror}); "
                            "check its permissions")

    out = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in dirnames:
            link = Path(dirpath, name)
            if link.is_symlink():
                raise UpcyclerError(
                    f"{shown_path(link)}: a symlink to the directory {shown_path(os.path.realpath(link))}; "
                    "only real directories are uploaded: replace the link with a copy of the directory"
                )
        for name in filenames:
            if not name.startswith(".") or name == ".gitattributes":
                rel = Path(dirpath, name).relative_to(root).as_posix()
                upload_source(root, rel)
                out.append(rel)
    return sorted(out)


def _check_weights(root: Path, files: list[str]) -> None:
    shards = [f for f in files if SHARD.fullmatch(f)]
    if INDEX in files and SINGLE in files:
        raise UpcyclerError(f"{shown_path(root / SINGLE)}: present next to {INDEX}, so loaders would pick "
                            "one; delete the stale one")
    if INDEX in files:
        _check_index(root, shards)
    elif shards:
        raise UpcyclerError(f"{shown_path(root / INDEX)}: missing, but {shards[0]} is a shard; {REWRITE}")
    elif SINGLE not in files:
        raise UpcyclerError(f"{shown_path(root)}: no {SINGLE} and no {INDEX}; "
                            "push a directory written by upcycler")


def _check_index(root: Path, shards: list[str]) -> None:
    weight_map = load_json_object(root / INDEX, fix=REWRITE, what="shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UpcyclerError(f"{shown_path(root / INDEX)}: no 'weight_map'; {REWRITE}")
    named = sorted({plain_member(root, name, root / INDEX, REWRITE).name for name in weight_map.values()})
    for name in named:
        if not (root / name).is_file():
            raise UpcyclerError(f"{shown_path(root / name)}: missing, but {INDEX} names it; "
                                f"copy it back or {REWRITE}")
    stray = sorted(set(shards) - set(named))
    if stray:
        raise UpcyclerError(f"{shown_path(root / stray[0])}: a shard {INDEX} does not name; "
                            f"delete it or {REWRITE}")


def _check_manifest_files(root: Path, manifest: Manifest, files: list[str], echo: Echo) -> None:
    entries = {name: {"bytes": size, "sha256": sha} for name, (size, sha) in manifest.file_records().items()}
    unlisted = [f for f in files if f.endswith(".safetensors") and f not in entries]
    if unlisted:
        raise UpcyclerError(f"{shown_path(root / unlisted[0])}: not listed in {MANIFEST}, "
                            f"so it cannot be checked; {REWRITE}")
    real = {}
    for name in sorted(entries):
        path = plain_member(root, name, root / MANIFEST, REWRITE)
        if not os.path.lexists(path):
            raise UpcyclerError(f"{shown_path(path)}: missing, but {MANIFEST} lists it; "
                                f"copy it back or {REWRITE}")
        real[name] = upload_source(root, name)
    for name, source in real.items():
        size, expected = source.stat().st_size, entries[name]["bytes"]
        if size != expected:
            raise UpcyclerError(f"{shown_path(root / name)}: {size} bytes but {MANIFEST} records {expected} "
                                f"(truncated?); {REWRITE}")
    for name, source in real.items():
        echo(f"checking sha256 of {name} ({human_bytes(entries[name]['bytes'])})")
        if sha256_file(source) != entries[name]["sha256"].lower():
            raise UpcyclerError(f"{shown_path(root / name)}: sha256 differs from {MANIFEST} "
                                f"(corrupted or modified); {REWRITE}")


# --- push --------------------------------------------------------------------------------------------


def push(
    directory: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    echo: Echo | None = None,
) -> str:
    """Upload a checked output directory to `repo_id` (created if missing); return the commit URL."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from upcycler.model_card import render_model_card  # it builds on this module's checks

    say = echo or (lambda _: None)
    root = Path(directory)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UpcyclerError(f"{describe(repo_id)}: not a Hub repo id; use NAMESPACE/NAME") from None
    files = validate_for_upload(root, echo=say)
    card = None if "README.md" in files else render_model_card(root, repo_id=repo_id)
    token = token or get_token()
    api = HfApi(endpoint=endpoint, token=token)
    target = f"{repo_id}@{revision}" if revision else repo_id
    say(f"pushing {len(files)} files to {target} at {api.endpoint}")
    with _staged(root, files, card) as stage, _hub_errors(repo_id, api.endpoint, token):
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=stage,
            revision=revision,
            commit_message=commit_message or f"Upload {root.resolve().name} with upcycler",
            delete_patterns=STALE_WEIGHTS,
        )
    return str(info.commit_url)


@contextmanager
def _staged(root: Path, files: list[str], card: str | None) -> Iterator[Path]:
    """A temporary directory of links to `files`, plus README.md holding `card` when given."""
    with tempfile.TemporaryDirectory(prefix="upcycler-push-") as tmp:
        stage = Path(tmp)
        for name in files:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / name).symlink_to(upload_source(root, name))  # checked again: nothing escapes
        if card is not None:
            (stage / "README.md").write_text(card, encoding="utf-8")
        yield stage


@contextmanager
def _hub_errors(repo_id: str, endpoint: str, token: str | None) -> Iterator[None]:
    """Turn Hub and network failures into one-line `UpcyclerError`s that never contain the token."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except (HfHubHTTPError, httpx2.TransportError, OSError, RuntimeError, ValueError) as err:
        cause = _root_cause(err, (HfHubHTTPError, httpx2.TransportError, ConnectionError, TimeoutError))
        if isinstance(cause, HfHubHTTPError):
            status = cause.response.status_code if cause.response is not None else 0
            msg = _http_error(status, _scrub(cause.server_message or "", token)[:200], repo_id, endpoint)
        elif cause is not None:
            kind = type(cause).__name__
            msg = f"could not reach {endpoint} ({kind}); check the network or --endpoint; {RETRY}"
        elif isinstance(err, ValueError) and "README.md" in str(err):
            why = str(err)[:300]
            msg = f"README.md: the Hub rejected its metadata ({why}); put a fixed README.md in the directory"
        else:
            raise
        raise UpcyclerError(_scrub(msg, token)) from None


def _root_cause(err: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `kinds` in the chain of causes of `err` (the client wraps some failures)."""
    seen: BaseException | None = err
    while seen is not None and not isinstance(seen, kinds):
        seen = seen.__cause__
    return seen


def _http_error(status: int, detail: str, repo_id: str, endpoint: str) -> str:
    if status in (401, 403):
        return f"not authorised to write {repo_id}: set HF_TOKEN or run `hf auth login`"
    if status == 404:
        return f"{repo_id} not found at {endpoint} (HTTP 404): check the repo id and --endpoint"
    said = f": {detail}" if detail else ""
    if status >= 500 or status in (408, 429):
        return f"the Hub failed while pushing {repo_id} (HTTP {status}{said}); {RETRY}"
    return f"the Hub refused the push to {repo_id} (HTTP {status}{said}); fix that and push again"


def _scrub(text: str, token: str | None) -> str:
    """`text` on one line, with the token and anything shaped like a Hub token masked."""
    if token:
        text = text.replace(token, "***")
    text = re.sub(r"\bhf_[A-Za-z0-9]{8,}", "hf_***", text)
    return " ".join(text.split())
