"""Sources that are not local paths: bucket prefixes (`gs://…`) and Hugging Face Hub ids.

Both become a local directory the readers stream from, so every check of a local source holds (the
digests of `upcycler.json` on every byte read, the hostile-input rules):

- a bucket prefix is mirrored into the upcycler cache (`$UPCYCLER_CACHE`, else `$XDG_CACHE_HOME/upcycler`,
  else `~/.cache/upcycler`), several objects at a time, each streamed to disk (memory stays a few buffers
  whatever the size). Every byte that arrives is checked against the CRC32C the bucket holds for the
  object (a source without `upcycler.json`, a user's own upload, is checked too): a mismatch is fetched
  once more, then refused in one line naming the object, and nothing of it stays in the mirror. A mirrored
  copy is trusted only as it was verified: the mirror's record holds, per object, the generation and
  CRC32C it matched and the copy's size and modification time then; an object whose record is missing or
  differs (a newer generation, a copy changed or cut short since, a cache from before this check) is
  fetched again, so a second command on the same source reads nothing from the bucket but its listing,
  and a rerun after a refused download fetches it afresh. A prefix that holds the marker of an unfinished
  upcycler write is refused. Every local path is built with `upcycler.locations.within` (the URL's key, each
  object name listed or matched by a glob): a name with a `.`, `..` or empty segment is refused before
  anything is fetched, and the mirror's clean-up deletes nothing outside the mirror's own directory;
- a Hub id (`org/name`, `hf://org/name`, either with `@revision`) is fetched by `huggingface_hub` into the
  HF cache (`HF_HOME`), from `HF_ENDPOINT`, honouring `HF_HUB_OFFLINE` and the usual token; only the
  files a checkpoint needs (`HUB_FILES`), not a repo's other copies of the weights. A revision with a `.`,
  `..` or empty segment is refused before the HF cache is touched, and a snapshot the Hub's answers would
  place outside the model's directory in the HF cache is refused.

What this module preserves: the local copy holds the source's files byte for byte under their names.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath

from upcycler.errors import UpcyclerError
from upcycler.io import object_store as store
from upcycler.io.bucket_output import refuse_unfinished
from upcycler.locations import bucket_and_key, remember_origin, url_scheme, within
from upcycler.untrusted import describe

_HUB_ID = re.compile(r"^(?:hf://)?([A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@([^@\s]+))?$")


def cache_root() -> Path:
    """The upcycler cache: bucket mirrors and staged bucket outputs live under it."""
    if os.environ.get("UPCYCLER_CACHE"):
        return Path(os.environ["UPCYCLER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "upcycler"


def hub_reference(text: str) -> tuple[str, str | None] | None:
    """`(repo_id, revision)` when `text` names a Hub model (`org/name[@rev]`, `hf://org/name[@rev]`)."""
    if text.startswith(".") or url_scheme(text) not in (None, "hf"):
        return None
    found = _HUB_ID.match(text)
    return (found.group(1), found.group(2)) if found else None


def _safe_name(url: str, name: str) -> PurePosixPath:
    """The object `name` listed under `url` as a path in the mirror; refused when it would leave it (`within`)."""
    within(url, name, fix="rename or remove that object")
    return PurePosixPath(name)


def _mirror_root(url: str) -> Path:
    """The local directory that mirrors the bucket prefix `url`: the cache's `gs/BUCKET/KEY`, which a key
    with a `.`, `..` or empty segment is refused before it names (`bucket_and_key`, `within`)."""
    bucket, key = bucket_and_key(url)
    return Path(within(str(cache_root() / "gs"), f"{bucket}/{key}" if key else bucket, named=describe(url, 200),
                       fix="write gs://BUCKET/PATH with no '.', '..' or empty segment"))


def mirror(url: str) -> Path:
    """The local copy of the bucket prefix (or single object) `url`, brought up to date."""
    local = _mirror_root(url)
    url = url.rstrip("/")
    objects = store.list_objects(url)
    if not objects:
        single = store.object_info(url)
        if single is None:
            raise UpcyclerError(f"{describe(url, 200)}: no such object or prefix; check the URL")
        objects, local, url = {single.name: single}, local.parent, url.rsplit("/", 1)[0]
        return _fetch(url, objects, local, keep_others=True) / single.name
    refuse_unfinished(url, objects)
    return _fetch(url, objects, local, keep_others=False)


def mirror_glob(pattern: str) -> list[Path]:
    """The local copies of the objects a gs:// glob (`gs://b/web/*.jsonl`, `**` for any depth) matches,
    sorted by name, each remembered as its URL for the lineage; [] when none matches. A match whose name has
    a `.`, `..` or empty segment is refused (`within`) before anything is fetched."""
    bucket = bucket_and_key(pattern)[0]
    urls = [within(f"gs://{bucket}", key.partition("/")[2], named=f"{describe(pattern, 200)}: its match "
                   f"{describe(f'gs://{key}', 200)}", fix="rename or remove that object, or narrow the glob")
            for key in sorted(store.glob_objects(pattern.split("://", 1)[1]))]
    copies = []
    for url in urls:
        copy = mirror(url)
        remember_origin(copy, url)
        copies.append(copy)
    return copies


def _verified(obj: store.StoredObject, copy: Path) -> dict:
    """The mirror's record of `copy` verified as `obj`: what the bucket listed (generation, CRC32C) and
    what the copy is now (size, modification time), so that a later change on either side shows."""
    stat = copy.stat()
    return {"generation": obj.generation, "crc32c": obj.crc32c, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _trusted(entry: object, obj: store.StoredObject, copy: Path) -> bool:
    """Whether the mirrored `copy` is `obj` as verified: its record (`entry`) is what `_verified` says now."""
    return copy.is_file() and bool(obj.crc32c) and entry == _verified(obj, copy)


def _read_record(record_path: Path) -> dict:
    """The mirror's record (object name → `_verified`), {} when there is none or it cannot be read."""
    try:
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(record_path: Path, record: dict) -> None:
    """Replace the mirror's record with `record` at once (a reader sees the old one or the new one)."""
    partial_record = record_path.with_name(f"{record_path.name}.partial-{os.getpid()}")
    partial_record.write_text(json.dumps(record, sort_keys=True))
    os.replace(partial_record, record_path)


def _fetch(url: str, objects: dict[str, store.StoredObject], local: Path, *, keep_others: bool) -> Path:
    """Bring the mirror `local` of the prefix `url` up to date with `objects` (its listing): every object
    not trusted as it stands (`_trusted`) is downloaded and checked (`store.download_checked`) before it
    replaces its copy. An object that fails leaves no copy and no record entry behind."""
    record_path = local.parent / f".{local.name}.mirror.json"
    record = _read_record(record_path)
    local.mkdir(parents=True, exist_ok=True)
    stale = {}  # name -> (target, partial) of the objects whose local copy is missing, out of date or unverified
    for name, obj in sorted(objects.items()):
        target = local / _safe_name(url, name)
        if _trusted(record.get(name), obj, target):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        stale[name] = (target, target.with_name(f".{target.name}.partial-{os.getpid()}"))
    if stale:
        for name, (target, _) in stale.items():  # evicted first: an interrupted fetch leaves nothing trusted
            record.pop(name, None)
            target.unlink(missing_ok=True)
        _write_record(record_path, record)
    store.download_checked([(store.join(url, name), objects[name], partial) for name, (_, partial) in stale.items()])
    for name, (target, partial) in stale.items():
        os.replace(partial, target)
        record[name] = _verified(objects[name], target)
    if not keep_others:
        _remove_unlisted(local, objects)
        record = {name: record[name] for name in objects}
    _write_record(record_path, record)
    return local


def _remove_unlisted(local: Path, objects: dict[str, store.StoredObject]) -> None:
    """Delete what the mirror `local` holds that the bucket no longer lists, then the directories that leaves
    empty. Only entries below `local` are touched: a link is removed itself, never followed."""
    for path in sorted(local.rglob("*"), reverse=True):
        name = path.relative_to(local).as_posix()
        if path.is_symlink() or path.is_file():
            if name not in objects:
                path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
"""What a Hub source needs (configs, safetensors shards and index, tokenizer files, remote code): a model
repo's other copies of the weights (`original/*.pth`, `*.bin`, GGUF) are not downloaded."""


def hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """The local snapshot of the Hub model `repo_id` at `revision` (fetched into the HF cache if needed)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}{'@' + revision if revision else ''}"
    if revision is not None:
        within(f"hf://{repo_id}", revision, named=describe(where, 200), fix="name a branch, tag or commit")
    try:
        return _in_hub_cache(Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)),
                             repo_id, where)
    except GatedRepoError:
        raise UpcyclerError(f"{where}: a gated model on the Hub; accept its terms and log in "
                            "(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UpcyclerError(f"{where}: no such local directory, and no such model at {constants.ENDPOINT} "
                            "(check the path or the Hub id; private models need HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UpcyclerError(f"{where}: no such revision on the Hub; check the branch, tag or commit") from None
    except LocalEntryNotFoundError:
        raise UpcyclerError(f"{where}: no such local directory, and not in the HF cache while offline "
                            "(HF_HUB_OFFLINE is set, or the Hub cannot be reached); check the path, or fetch "
                            "it with network access") from None
    except OSError as err:
        raise UpcyclerError(f"{where}: fetching it from {constants.ENDPOINT} failed ({describe(str(err), 160)}); "
                            "check the network, or pass a local directory") from None


def _in_hub_cache(snapshot: Path, repo_id: str, where: str) -> Path:
    """`snapshot` when it lies in the HF cache's directory of `repo_id` (the commit id the Hub answered names
    it); refused otherwise (`within`)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    snapshots = os.path.realpath(os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id,
                                                                                         repo_type="model"),
                                              "snapshots"))
    within(snapshots, os.path.relpath(os.path.realpath(snapshot), snapshots),
           named=f"{describe(where, 200)}: its snapshot", fix=f"check that {constants.ENDPOINT} is the Hub")
    return snapshot
