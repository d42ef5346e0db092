"""Bucket locations (`gs://bucket/key`): our own reads, writes and listings of objects, through gcsfs with
the client settings of `upcycler.bucket_client` (chosen so that no command hangs or crawls on a bucket).

Every failure becomes an `UpcyclerError` naming the URL. What this module preserves: bytes are moved
as they are, streamed between a local file and an object (never whole in memory).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upcycler.bucket_client import StorageUnanswered, bucket_filesystem_class, configure
from upcycler.errors import UpcyclerError
from upcycler.locations import bucket_and_key, url_scheme
from upcycler.untrusted import describe

SCHEMES = ("gs",)
"""The bucket schemes the tool reads and writes."""
UPLOADS_AT_ONCE = 8  # files moved concurrently by `upload_all` and `download_all` (each a stream of its own)


@dataclass(frozen=True)
class StoredObject:
    """One object under a prefix: its name relative to the prefix, size and generation (its version)."""

    name: str
    size: int
    generation: str


def is_bucket_url(text: str | os.PathLike) -> bool:
    """Whether `text` names a location in a bucket (`gs://…`)."""
    return isinstance(text, str) and url_scheme(text) in SCHEMES


def join(url: str, *names: str) -> str:
    """`url` with `names` appended, one `/` between parts."""
    return "/".join([url.rstrip("/"), *(n.strip("/") for n in names)])


def _key(url: str) -> str:
    """`gs://bucket/a/b` → `bucket/a/b` (gcsfs's form), checked to name a bucket (`bucket_and_key`)."""
    bucket, key = bucket_and_key(url)
    return f"{bucket}/{key}" if key else bucket


@functools.lru_cache(maxsize=1)
def filesystem() -> Any:
    """The gcsfs client of this process, with the settings of `upcycler.bucket_client`."""
    configure()
    return bucket_filesystem_class()(skip_instance_cache=True)


@contextmanager
def _errors(url: str, doing: str) -> Iterator[None]:
    """Turn a client failure while `doing` something at `url` into one line."""
    try:
        yield
    except StorageUnanswered as err:
        raise UpcyclerError(f"{describe(url, 200)}: {err}") from err
    except UpcyclerError:
        raise
    except FileNotFoundError as err:
        raise UpcyclerError(f"{describe(url, 200)}: no such object or bucket; check the URL") from err
    except PermissionError as err:
        raise UpcyclerError(f"{describe(url, 200)}: permission denied while {doing} "
                            f"({describe(str(err), 120)}); check the credentials") from err
    except OSError as err:
        raise UpcyclerError(f"{describe(url, 200)}: {doing} failed ({describe(str(err), 160)}); "
                            f"check the network and the bucket, then retry") from err
    except Exception as err:  # the client's own errors (HTTP, auth) have no common base
        raise UpcyclerError(f"{describe(url, 200)}: {doing} failed ({type(err).__name__}: "
                            f"{describe(str(err), 160)}); check the network and the credentials") from err


def list_objects(url: str) -> dict[str, StoredObject]:
    """Every object under the prefix `url` (as a directory), by name relative to it; {} when none."""
    prefix = _key(url) + "/"
    with _errors(url, "listing"):
        found = filesystem().find(prefix, detail=True)
    return {key[len(prefix):]: StoredObject(key[len(prefix):], int(info.get("size") or 0),
                                            str(info.get("generation", "")))
            for key, info in found.items() if key.startswith(prefix) and info.get("type") != "directory"}


def glob_objects(pattern: str) -> list[str]:
    """The objects (as `bucket/key`) that the glob `bucket/pattern` matches; directories are left out."""
    with _errors(f"gs://{pattern}", "listing"):
        found = filesystem().glob(_key(f"gs://{pattern}"), detail=True)
    return sorted(key for key, info in found.items() if info.get("type") != "directory")


def probe(url: str) -> None:
    """One request that lists at most one object under `url`: raises `UpcyclerError` naming `url` when
    Cloud Storage does not answer, the bucket does not exist or the listing is refused; changes nothing."""
    bucket, key = bucket_and_key(url)
    with _errors(url, "listing"):
        try:
            filesystem().call("GET", "b/{}/o", bucket, json_out=True, prefix=f"{key}/" if key else None,
                              maxResults=1)
        except FileNotFoundError:
            raise UpcyclerError(f"{describe(url, 200)}: no such bucket {describe(bucket)}; check the URL "
                                "(or create the bucket)") from None


def object_info(url: str) -> StoredObject | None:
    """The object named exactly `url`, or None when there is none."""
    with _errors(url, "reading the object's metadata"):
        try:
            info = filesystem().info(_key(url))
        except FileNotFoundError:
            return None
    if info.get("type") == "directory":
        return None
    return StoredObject(_key(url).rsplit("/", 1)[-1], int(info.get("size") or 0), str(info.get("generation", "")))


def download_all(pairs: list[tuple[str, Path]]) -> None:
    """Stream each object into its local file (replaced), several at a time (`UPLOADS_AT_ONCE`): a sharded
    checkpoint's files come down side by side. Returns once every download has finished."""
    if not pairs:
        return
    with _errors(pairs[0][0], "downloading"):
        filesystem().get([_key(url) for url, _ in pairs], [str(local) for _, local in pairs],
                         batch_size=UPLOADS_AT_ONCE)


def upload_all(pairs: list[tuple[Path, str]]) -> None:
    """Stream each local file into its object (replaced), several at a time: a sharded checkpoint's files
    go up side by side, not one after another. Returns once every upload has finished."""
    if not pairs:
        return
    with _errors(pairs[0][1], "uploading"):
        filesystem().put([str(local) for local, _ in pairs], [_key(url) for _, url in pairs],
                         batch_size=UPLOADS_AT_ONCE)


def write_bytes(url: str, data: bytes) -> None:
    """Write the object `url` with `data` (small objects: markers, metrics)."""
    with _errors(url, "writing"):
        filesystem().pipe_file(_key(url), data)


def read_bytes(url: str) -> bytes:
    """The bytes of the object `url` (small objects: markers, metrics, configs)."""
    with _errors(url, "reading"):
        return filesystem().cat_file(_key(url))


def read_range(url: str, start: int, stop: int) -> bytes:
    """The bytes [start, stop) of the object `url` (one ranged GET)."""
    return read_ranges([(url, start, stop)])[0]


def read_ranges(requests: list[tuple[str, int, int]]) -> list[bytes]:
    """The bytes [start, stop) of each (url, start, stop), fetched concurrently in one call: the reads a
    training batch needs arrive together, not one round trip after another."""
    if not requests:
        return []
    with _errors(requests[0][0], "reading"):
        return filesystem().cat_ranges([_key(u) for u, _, _ in requests], [a for _, a, _ in requests],
                                       [b for _, _, b in requests], on_error="raise")


def remove(urls: list[str]) -> None:
    """Delete the objects `urls` (missing ones are not an error)."""
    if not urls:
        return
    with _errors(urls[0], "deleting"):
        fs = filesystem()
        for url in urls:
            try:
                fs.rm_file(_key(url))
            except FileNotFoundError:
                pass
