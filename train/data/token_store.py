"""Random access to one source's token stream, which lives in one or more files (shards), local or in a
bucket: `tokens[a:b]` and `read_spans` for many ranges at once.

Files are read with positioned reads (`os.pread` locally, ranged GETs in a bucket, many at once), never
memory-mapped or downloaded whole: a host's memory does not grow with the data it has read. Open file
descriptors are bounded process-wide (`MAX_OPEN_FILES`, least recently used closed first) whatever the
number of sources and shards, and no thread is started per source or shard.

Every shard is checked when its source is opened (`verify`) and again whenever a closed file is reopened:
its header must equal the one its index or metadata implies, byte for byte, and its size must be exactly
header + tokens. A shard that was replaced,
swapped with another, truncated or extended is refused with one line naming it.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.untrusted import open_regular, shown_path

MAX_OPEN_FILES = 64
_FIX = "re-run upcycle prepare-data"


@dataclass(frozen=True)
class ShardFile:
    """One file of a token stream: where it is, the header it must start with, and its token count."""

    location: str  # a local path or a gs:// URL
    header: bytes
    tokens: int
    itemsize: int
    index_file: str  # the index or metadata that describes it, for messages


class _LocalFiles:
    """Positioned reads of local shards through a bounded, least-recently-used set of open descriptors."""

    def __init__(self, most: int = MAX_OPEN_FILES):
        self.most = most
        self._open: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, shard: ShardFile, start: int, stop: int) -> bytes:
        fd = self._descriptor(shard)
        data = os.pread(fd, stop - start, start)
        if len(data) != stop - start:
            raise UpcyclerError(f"{shown_path(shard.location)}: shorter than {shard.index_file} says "
                                f"(truncated while in use); {_FIX}")
        return data

    def _descriptor(self, shard: ShardFile) -> int:
        with self._lock:
            fd = self._open.get(shard.location)
            if fd is not None:
                self._open.move_to_end(shard.location)
                return fd
            fd = open_regular(shard.location, "token file")
            try:
                _check(shard, os.pread(fd, len(shard.header), 0), os.fstat(fd).st_size)
            except BaseException:
                os.close(fd)
                raise
            self._open[shard.location] = fd
            while len(self._open) > self.most:
                os.close(self._open.popitem(last=False)[1])
            return fd

    def check(self, shard: ShardFile) -> None:
        """Open (and so check) `shard` now."""
        self._descriptor(shard)

    def open_count(self) -> int:
        return len(self._open)


class _BucketFiles:
    """Ranged reads of shards in a bucket, many in one concurrent call."""

    def check_all(self, shards: Sequence[ShardFile]) -> None:
        """Check every shard's size and header: one listing per directory, the headers in one call."""
        from upcycler.io import object_store as store

        sizes: dict[str, int] = {}
        for directory in sorted({s.location.rsplit("/", 1)[0] for s in shards}):
            sizes.update({store.join(directory, name): obj.size for name, obj in store.list_objects(directory).items()})
        present = [s for s in shards if s.location in sizes]
        headers = dict(zip((s.location for s in present),
                           store.read_ranges([(s.location, 0, len(s.header)) for s in present])))
        for shard in shards:
            _check(shard, headers.get(shard.location, b""), sizes.get(shard.location, -1))

    def read_many(self, requests: Sequence[tuple[ShardFile, int, int]]) -> list[bytes]:
        from upcycler.io import object_store as store

        return store.read_ranges([(s.location, a, b) for s, a, b in requests])


def _check(shard: ShardFile, header: bytes, size: int) -> None:
    """Refuse a shard whose header or size is not what its index says."""
    if size < 0:
        raise UpcyclerError(f"{shown_path(shard.location)}: missing (listed in {shard.index_file}); {_FIX}")
    if header != shard.header:
        raise UpcyclerError(f"{shown_path(shard.location)}: does not match {shard.index_file} (replaced, "
                            f"swapped with another shard, or corrupt); {_FIX}")
    expected = len(shard.header) + shard.tokens * shard.itemsize
    if size != expected:
        raise UpcyclerError(f"{shown_path(shard.location)}: holds {size:,} bytes, {shard.index_file} says "
                            f"{expected:,} (truncated or extended); {_FIX}")


_LOCAL = _LocalFiles()
_BUCKET = _BucketFiles()


class TokenStream:
    """The concatenation of a source's shards as one read-only 1-D array of `dtype` ids: `len`, `shape`,
    `stream[a:b]` (a copy), and `read_spans` to read many ranges in one go (concurrently in a bucket)."""

    def __init__(self, shards: Sequence[ShardFile], dtype: np.dtype):
        self.shards = tuple(shards)
        self.dtype = np.dtype(dtype)
        self._ends = np.cumsum([s.tokens for s in self.shards]).tolist()
        self.remote = any("://" in s.location for s in self.shards)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def verify(self) -> None:
        """Check every shard against its index now (size and header), not at its first read."""
        if self.remote:
            _BUCKET.check_all(self.shards)
        else:
            for shard in self.shards:
                _LOCAL.check(shard)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a token stream is read by contiguous slices")
        start, stop, _ = key.indices(len(self))
        return self.read_spans([(start, max(start, stop))])[0]

    def read_spans(self, spans: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """The tokens of each [start, stop) span (clipped to the stream), as arrays of `dtype`."""
        requests, owners = [], []
        for number, (start, stop) in enumerate(spans):
            start, stop = max(0, start), min(stop, len(self))
            first = bisect.bisect_right(self._ends, start)
            while start < stop:
                begin = self._ends[first - 1] if first else 0
                end = min(stop, self._ends[first])
                shard = self.shards[first]
                offset = len(shard.header)
                item = self.dtype.itemsize
                requests.append((shard, offset + (start - begin) * item, offset + (end - begin) * item))
                owners.append(number)
                start, first = end, first + 1
        if self.remote:
            pieces = _BUCKET.read_many(requests)
        else:
            pieces = [_LOCAL.read(shard, a, b) for shard, a, b in requests]
        joined: list[list[bytes]] = [[] for _ in spans]
        for owner, piece in zip(owners, pieces):
            joined[owner].append(piece)
        return [np.frombuffer(b"".join(parts), dtype=self.dtype) for parts in joined]


def open_files() -> int:
    """Descriptors of local shards this process holds open (bounded by `MAX_OPEN_FILES`)."""
    return _LOCAL.open_count()
