"""Publishing an output directory to the Hugging Face Hub: check it, then upload it with a model card.

- `validate_for_upload` proves a directory is complete before anything touches the network: `config.json`
  parses, the shard index names only shards that are there, and every file the manifest `upcycler.json`
  lists has the recorded size and sha256 (hashed in a stream).
- `push` creates the repo (and branch), then uploads the checked files plus the model card of
  `upcycler.model_card` (only when the directory has no README.md) from a temporary staging directory of
  links, so the user's directory is never changed. Weight files of an earlier push that this one does not
  replace are deleted in the same commit. Hub failures become one-line `UpcyclerError`s with the token
  scrubbed; re-running resumes an upload.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import MANIFEST
from upcycler.io.hashing import sha256_file
from upcycler.io.hf_read import INDEX, SINGLE, plain_member, read_json
from upcycler.summary import human_bytes

Echo = Callable[[str], None]

CONFIG = "config.json"
SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
STALE_WEIGHTS = [SINGLE, "model-*-of-*.safetensors", INDEX]
REWRITE = "re-write the directory with upcycler"
RETRY = "run the same command again: a retry resumes and skips files already uploaded"


# --- validation --------------------------------------------------------------------------------------


def validate_for_upload(directory: str | os.PathLike[str], *, echo: Echo | None = None) -> list[str]:
    """Check `directory` is a complete, uncorrupted upcycler output; return the files to upload (sorted)."""
    root = Path(directory)
    if not root.is_dir():
        raise UpcyclerError(f"{root}: not a directory; pass the output directory upcycler wrote")
    read_json(root / CONFIG, REWRITE)
    files = _list_files(root)
    manifest = read_manifest(root)
    _check_weights(root, files)
    _check_manifest_files(root, manifest, files, echo or (lambda _: None))
    return files


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest `upcycler.json`, with its `files` table checked for shape."""
    manifest = read_json(root / MANIFEST, REWRITE)
    if manifest.get("format") != 1:
        raise UpcyclerError(f"{root / MANIFEST}: unknown format {manifest.get('format')!r}; upgrade upcycler")
    files = manifest.get("files")
    ok = isinstance(files, dict) and all(
        isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("bytes"), int)
        for e in files.values()
    )
    if not ok:
        raise UpcyclerError(f"{root / MANIFEST}: 'files' must map names to {{sha256, bytes}}; {REWRITE}")
    return manifest


def _list_files(root: Path) -> list[str]:
    """Every file under `root` as a POSIX relative path, skipping hidden ones (but not `.gitattributes`)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") or name == ".gitattributes":
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(out)


def _check_weights(root: Path, files: list[str]) -> None:
    shards = [f for f in files if SHARD.fullmatch(f)]
    if INDEX in files and SINGLE in files:
        raise UpcyclerError(
            f"{root / SINGLE}: present next to {INDEX}, so loaders would pick one; delete the stale one"
        )
    if INDEX in files:
        _check_index(root, shards)
    elif shards:
        raise UpcyclerError(f"{root / INDEX}: missing, but {shards[0]} is a shard; {REWRITE}")
    elif SINGLE not in files:
        raise UpcyclerError(f"{root}: no {SINGLE} and no {INDEX}; push a directory written by upcycler")


def _check_index(root: Path, shards: list[str]) -> None:
    weight_map = read_json(root / INDEX, REWRITE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UpcyclerError(f"{root / INDEX}: no 'weight_map'; {REWRITE}")
    named = sorted(set(weight_map.values()))
    for name in named:
        if not plain_member(root, name, root / INDEX, REWRITE).is_file():
            raise UpcyclerError(f"{root / name}: missing, but {INDEX} names it; copy it back or {REWRITE}")
    stray = sorted(set(shards) - set(named))
    if stray:
        raise UpcyclerError(f"{root / stray[0]}: a shard {INDEX} does not name; delete it or {REWRITE}")


def _check_manifest_files(root: Path, manifest: dict[str, Any], files: list[str], echo: Echo) -> None:
    entries: dict[str, dict[str, Any]] = manifest["files"]
    unlisted = [f for f in files if f.endswith(".safetensors") and f not in entries]
    if unlisted:
        raise UpcyclerError(
            f"{root / unlisted[0]}: not listed in {MANIFEST}, so it cannot be checked; {REWRITE}"
        )
    paths = {name: plain_member(root, name, root / MANIFEST, REWRITE) for name in sorted(entries)}
    for name, path in paths.items():
        if not path.is_file():
            raise UpcyclerError(f"{path}: missing, but {MANIFEST} lists it; copy it back or {REWRITE}")
        size, expected = path.stat().st_size, entries[name]["bytes"]
        if size != expected:
            raise UpcyclerError(
                f"{path}: {size} bytes but {MANIFEST} records {expected} (truncated?); {REWRITE}"
            )
    for name, path in paths.items():
        echo(f"checking sha256 of {name} ({human_bytes(entries[name]['bytes'])})")
        if sha256_file(path) != entries[name]["sha256"].lower():
            raise UpcyclerError(f"{path}: sha256 differs from {MANIFEST} (corrupted or modified); {REWRITE}")


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
        raise UpcyclerError(f"{repo_id!r}: not a Hub repo id; use NAMESPACE/NAME") from None
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
            (stage / name).symlink_to((root / name).resolve())
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
