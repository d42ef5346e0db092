"""Bucket locations (`gs://bucket/key`): our own reads, writes and listings of objects, through gcsfs with
the client settings of `upcycler.bucket_client` (chosen so that no command hangs or crawls on a bucket).

Every failure becomes an `UpcyclerError` naming the URL. What this module preserves: bytes are moved
as they are, streamed between a local file and an object (never whole in memory); a download is kept only
once its bytes match the CRC32C the bucket holds for the object (`download_checked`), and an upload is
done once the bucket holds the bytes sent (`upload_all`, `write_bytes`).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import zlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from upcycler.bucket_client import (
    DEADLINE_VARIABLE,
    StorageUnanswered,
    bucket_filesystem_class,
    configure,
    retried,
)
from upcycler.errors import UpcyclerError
from upcycler.locations import bucket_and_key, url_scheme
from upcycler.untrusted import describe

SCHEMES = ("gs",)
"""The bucket schemes the tool reads and writes."""
UPLOADS_AT_ONCE = 8  # files moved concurrently by `upload_all` and `download_checked` (each a stream of its own)
DOWNLOAD_TRIES = 2  # a download whose bytes differ from the object's CRC32C is fetched once more, then refused
UPLOAD_TRIES = 2  # an upload the bucket holds otherwise than sent is sent once more, then refused
_PIECE = 1024 * 1024  # how much of a download is written and hashed at a time


@dataclass(frozen=True)
class StoredObject:
    """One object under a prefix: its name relative to the prefix, size, generation (its version) and the
    CRC32C the bucket holds for that generation (base64 of the big-endian value, as Cloud Storage writes
    it; "" when the bucket gave none). Every object has one, composite objects too (they have no MD5)."""

    name: str
    size: int
    generation: str
    crc32c: str = ""


def _stored(name: str, info: dict[str, Any]) -> StoredObject:
    """The `StoredObject` named `name` that gcsfs's metadata `info` describes."""
    return StoredObject(name, int(info.get("size") or 0), str(info.get("generation", "")),
                        str(info.get("crc32c") or ""))


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
        status = getattr(err, "code", None)
        if isinstance(status, int) and (status in (408, 429) or status >= 500):
            raise UpcyclerError(f"{describe(url, 200)}: {doing} failed: Cloud Storage answered {status} "
                                f"({describe(str(getattr(err, 'message', err)), 120)}) to every try of the retry "
                                f"policy ({DEADLINE_VARIABLE} sets how long); rerun once the bucket answers") from err
        raise UpcyclerError(f"{describe(url, 200)}: {doing} failed ({type(err).__name__}: "
                            f"{describe(str(err), 160)}); check the network and the credentials") from err


def list_objects(url: str) -> dict[str, StoredObject]:
    """Every object under the prefix `url` (as a directory), by name relative to it; {} when none."""
    prefix = _key(url) + "/"
    with _errors(url, "listing"):
        found = filesystem().find(prefix, detail=True)
    return {key[len(prefix):]: _stored(key[len(prefix):], info)
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
    return _stored(_key(url).rsplit("/", 1)[-1], info)


def crc32c_text(checksum: Any) -> str:
    """A `google_crc32c.Checksum`'s value as Cloud Storage writes it: base64 of the 4 big-endian bytes."""
    return base64.b64encode(checksum.digest()).decode()


class _HashedCopy:
    """A local file written piece by piece (replaced), with the CRC32C of every byte given to it; with
    `gunzip`, the pieces are a gzip stream, hashed as given and written decompressed."""

    def __init__(self, path: Path, gunzip: bool = False):
        import google_crc32c

        self._file = open(path, "wb")  # noqa: SIM115  (closed by __exit__)
        self._checksum = google_crc32c.Checksum()
        self._gunzip = zlib.decompressobj(16 + zlib.MAX_WBITS) if gunzip else None
        self._undecodable = False

    def write(self, piece: bytes) -> None:
        self._checksum.update(piece)
        if self._gunzip is None:
            self._file.write(piece)
        elif not self._undecodable:
            try:
                self._file.write(self._gunzip.decompress(piece))
            except zlib.error:  # damaged: its checksum tells, and it is read again
                self._undecodable = True

    def crc32c(self) -> str:
        """The CRC32C of what was given (`crc32c_text`); marked when a gzip stream did not decode whole."""
        whole = self._gunzip is None or (not self._undecodable and self._gunzip.eof)
        return crc32c_text(self._checksum) + ("" if whole else " (not a whole gzip stream)")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


async def _stream_into(fs: Any, key: str, generation: str, local: Path) -> str:
    """Write the bytes of generation `generation` of the object `key` into `local` (replaced) as they arrive,
    in one GET (one try: no retry here), hashing them on the way; returns their CRC32C (`crc32c_text`). An
    object stored gzip-compressed arrives compressed: its compressed bytes are hashed (the bucket's CRC32C
    is of them) and its content written."""
    from gcsfs.retry import validate_response

    await fs._set_session()
    async with fs.session.get(fs.url(key, generation=generation or None), params=fs._get_params({}),
                              headers=fs._get_headers(None), timeout=fs.requests_timeout,
                              auto_decompress=False) as answer:
        if answer.status >= 400:
            validate_response(answer.status, await answer.read(), key)
        gzipped = answer.headers.get("content-encoding", "") == "gzip"
        with _HashedCopy(local, gzipped) as copy:
            async for piece in answer.content.iter_chunked(_PIECE):
                copy.write(piece)
        return copy.crc32c()


async def _download_checked_one(fs: Any, url: str, obj: StoredObject, local: Path) -> None:
    """Stream the object `url` (the generation `obj` names) into `local`; keep it only once its CRC32C is
    `obj.crc32c`, fetching it again on a mismatch (`DOWNLOAD_TRIES` in all). `local` is removed whenever
    this fails, so no unchecked byte is ever left behind."""
    try:
        with _errors(url, "downloading"):
            if not obj.crc32c:
                raise UpcyclerError(f"{describe(url, 200)}: the bucket holds no CRC32C for it, so its bytes cannot "
                                    "be checked; copy it to a Cloud Storage bucket (every object there has one)")
            read: list[str] = []  # the CRC32C of each download
            while len(read) < DOWNLOAD_TRIES and obj.crc32c not in read:
                read.append(await _stream_generation(fs, url, obj, local))
        if obj.crc32c not in read:
            raise UpcyclerError(f"{describe(url, 200)}: downloaded {len(read)} times, its bytes never matched the "
                                f"CRC32C the bucket holds for it ({obj.crc32c}; read {', '.join(read)}): corrupted "
                                "on the way (check the network or proxy, then rerun) or in the bucket (upload it "
                                "again)")
    except BaseException:
        local.unlink(missing_ok=True)
        raise


async def _stream_generation(fs: Any, url: str, obj: StoredObject, local: Path) -> str:
    """`_stream_into` for the generation `obj` names, tried as the retry policy says; one line when that
    generation is gone (the object was replaced or deleted since it was listed)."""
    try:
        return await retried(lambda: _stream_into(fs, _key(url), obj.generation, local))
    except FileNotFoundError:
        raise UpcyclerError(f"{describe(url, 200)}: replaced or deleted while it was being read (generation "
                            f"{obj.generation} is gone); rerun once it stays put") from None


async def _at_most(limit: int, jobs: list[Callable[[], Awaitable[None]]]) -> None:
    """Run `jobs`, at most `limit` at a time; the first failure cancels the others and is raised."""
    slots = asyncio.Semaphore(limit)

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with slots:
            await job()

    tasks = [asyncio.ensure_future(run(job)) for job in jobs]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def download_checked(downloads: list[tuple[str, StoredObject, Path]]) -> None:
    """Stream each object (URL, its listing) into its local file (replaced), several at a time
    (`UPLOADS_AT_ONCE`): a sharded checkpoint's files come down side by side. Each file is kept only once
    its bytes match the CRC32C of the generation listed (hashed as they arrive, no second read), and is
    fetched once more when they do not; an object that never matches is refused in one line naming it.
    Returns once every download has finished; on a failure, none of the files is left."""
    if not downloads:
        return
    from fsspec.asyn import sync

    fs = filesystem()
    try:
        sync(fs.loop, _at_most, UPLOADS_AT_ONCE,
             [functools.partial(_download_checked_one, fs, url, obj, local) for url, obj, local in downloads])
    except BaseException:
        for _, _, local in downloads:
            local.unlink(missing_ok=True)
        raise


def upload_all(pairs: list[tuple[Path, str]]) -> None:
    """Stream each local file into its object (replaced), several at a time: a sharded checkpoint's files
    go up side by side, not one after another. Returns once every upload has finished and the bucket holds
    each file's bytes (`_uploaded_as_sent`: one listing per directory against the files' CRC32C); a file the
    bucket holds otherwise is sent once more, then refused in one line naming its object."""
    if not pairs:
        return
    for _ in range(UPLOAD_TRIES):
        with _errors(pairs[0][1], "uploading"):
            filesystem().put([str(local) for local, _ in pairs], [_key(url) for _, url in pairs],
                             batch_size=UPLOADS_AT_ONCE)
        pairs = _not_as_sent(pairs)
        if not pairs:
            return
    _refuse_stored(pairs[0][1])


def write_bytes(url: str, data: bytes) -> None:
    """Write the object `url` with `data` (small objects: markers, metrics), checked as `upload_all` checks
    its files."""
    import google_crc32c

    for _ in range(UPLOAD_TRIES):
        with _errors(url, "writing"):
            filesystem().pipe_file(_key(url), data)
        stored = object_info(url)
        if stored is not None and stored.crc32c == crc32c_text(google_crc32c.Checksum(data)):
            return
    _refuse_stored(url)


def _not_as_sent(pairs: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """The (file, object) pairs whose object does not hold the file's bytes (by CRC32C), listed once per
    directory."""
    import google_crc32c

    stored: dict[str, StoredObject] = {}
    for directory in sorted({url.rsplit("/", 1)[0] for _, url in pairs}):
        if bucket_and_key(directory)[1]:
            stored |= {join(directory, name): obj for name, obj in list_objects(directory).items()}
        else:  # at the top of a bucket: not a listing of the whole bucket
            stored |= {url: obj for _, url in pairs if url.rsplit("/", 1)[0] == directory
                       and (obj := object_info(url)) is not None}
    wrong = []
    for local, url in pairs:
        checksum = google_crc32c.Checksum()
        with open(local, "rb") as f:
            while piece := f.read(_PIECE * 8):
                checksum.update(piece)
        if url not in stored or stored[url].crc32c != crc32c_text(checksum):
            wrong.append((local, url))
    return wrong


def _refuse_stored(url: str) -> None:
    raise UpcyclerError(f"{describe(url, 200)}: written {UPLOAD_TRIES} times, the bucket never held the bytes sent "
                        "(its CRC32C differs): corrupted on the way; check the network or proxy, then rerun")


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
