"""Random access to one source's token stream, which lives in one or more files (shards), local or in a
bucket: `tokens[a:b]` and `read_spans` for many ranges at once.

Files are read with positioned reads (`os.pread` locally, ranged GETs in a bucket, many at once), never
memory-mapped or downloaded whole: a host's memory does not grow with the data it has read. Open file
descriptors are bounded process-wide (`MAX_OPEN_FILES`, least recently used closed first) whatever the
number of sources and shards, and no thread is started per source or shard.

Every shard is checked when its source is opened (`verify`) and again whenever a closed file is reopened:
its header must equal the one its index or metadata implies, byte for byte, and its size must be exactly
header + tokens. A shard that was replaced, swapped with another, truncated or extended is refused with one
line naming it.

Where the index holds the CRC32C of each block of a shard (`format.BlockChecksums`), every read covers whole
blocks and each block is checked before a token of it is used: a block whose bytes do not match is read
once more (a bit flipped on the way), then refused in one line naming the shard and the block. The last
`CHECKED_BLOCKS_KEPT` checked blocks are kept, so neighbouring reads (an evaluation walking the stream) read
each block once.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.data.format import block_crc32c
from upcycler.untrusted import open_regular, shown_path

MAX_OPEN_FILES = 64
CHECKED_BLOCKS_KEPT = 32  # checked blocks kept for the next reads, process-wide (8 MiB at the default size)
BLOCK_READS = 2  # a block (or a header) that does not match its index is read once more, then refused
_FIX = "re-run upcycle prepare-data"


@dataclass(frozen=True)
class ShardFile:
    """One file of a token stream: where it is, the header it must start with, and its token count."""

    location: str  # a local path or a gs:// URL
    header: bytes
    tokens: int
    itemsize: int
    index_file: str  # the index or metadata that describes it, for messages
    blocks: tuple[int, bytes] | None = None  # (block size, 4 bytes of CRC32C per block); None: unchecked


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
        headers: dict[str, bytes] = {}
        for _ in range(BLOCK_READS):  # a header that differs is read once more (damaged on the way?)
            again = [s for s in present if headers.get(s.location) != s.header]
            headers.update(zip((s.location for s in again),
                               store.read_ranges([(s.location, 0, len(s.header)) for s in again])))
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
        pieces = _CHECKED.read(requests, self._read_unchecked)
        joined: list[list[bytes]] = [[] for _ in spans]
        for owner, piece in zip(owners, pieces):
            joined[owner].append(piece)
        return [np.frombuffer(b"".join(parts), dtype=self.dtype) for parts in joined]

    def _read_unchecked(self, requests: Sequence[tuple[ShardFile, int, int]]) -> list[bytes]:
        """The bytes of each (shard, start, stop), as stored: concurrently from a bucket, else by pread."""
        if self.remote:
            return _BUCKET.read_many(requests)
        return [_LOCAL.read(shard, a, b) for shard, a, b in requests]


class _CheckedBlocks:
    """Reads of shards through their checksummed blocks (see the module docstring), with the last
    `CHECKED_BLOCKS_KEPT` checked blocks kept."""

    def __init__(self, kept: int = CHECKED_BLOCKS_KEPT):
        self.kept = kept
        self._blocks: OrderedDict[tuple[str, int, bytes], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, requests: Sequence[tuple[ShardFile, int, int]],
             read_raw: Callable[[Sequence[tuple[ShardFile, int, int]]], list[bytes]]) -> list[bytes]:
        """The bytes of each (shard, start, stop); those of a shard with block checksums only once checked."""
        wanted = {block for shard, a, b in requests if shard.blocks for block in _blocks_of(shard, a, b)}
        blocks = self._checked(sorted(wanted, key=lambda k: (k[0].location, k[1])), read_raw)
        unchecked = [(shard, a, b) for shard, a, b in requests if not shard.blocks]
        plain = iter(read_raw(unchecked) if unchecked else [])
        return [_cut(shard, a, b, blocks) if shard.blocks else next(plain) for shard, a, b in requests]

    def _checked(self, wanted: list[tuple[ShardFile, int]], read_raw) -> dict[tuple[str, int, bytes], bytes]:
        """Each wanted (shard, block) by `_key`, checked: kept ones, the others read (again once
        when they do not match)."""
        with self._lock:
            found = {_key(s, k): self._blocks[_key(s, k)] for s, k in wanted
                     if _key(s, k) in self._blocks}
        missing = [(s, k) for s, k in wanted if _key(s, k) not in found]
        for _ in range(BLOCK_READS):
            if not missing:
                break
            data = read_raw([_block_range(s, k) for s, k in missing])
            good = {_key(s, k): d for (s, k), d in zip(missing, data) if block_crc32c(d) == _expected(s, k)}
            found |= good
            missing = [(s, k) for s, k in missing if _key(s, k) not in good]
        if missing:
            shard, block = missing[0]
            _, start, stop = _block_range(shard, block)
            raise UpcyclerError(f"{shown_path(shard.location)}: block {block} (bytes {start:,}-{stop:,}) read "
                                f"{BLOCK_READS} times, its bytes never matched the CRC32C {shard.index_file} holds "
                                "for it: corrupted on the way (check the network or proxy, then rerun) or where it "
                                f"is stored ({_FIX})")
        with self._lock:
            for key in (key for key in found if key not in self._blocks):
                self._blocks[key] = found[key]
            while len(self._blocks) > self.kept:
                self._blocks.popitem(last=False)
        return found


def _blocks_of(shard: ShardFile, start: int, stop: int) -> list[tuple[ShardFile, int]]:
    """The blocks of `shard` that the file bytes [start, stop) fall in."""
    size, offset = shard.blocks[0], len(shard.header)
    return [(shard, k) for k in range((start - offset) // size, (stop - offset - 1) // size + 1)] if stop > start else []


def _block_range(shard: ShardFile, block: int) -> tuple[ShardFile, int, int]:
    """The read of `shard`'s block `block`: its file bytes [start, stop)."""
    size, offset = shard.blocks[0], len(shard.header)
    return shard, offset + block * size, offset + min((block + 1) * size, shard.tokens * shard.itemsize)


def _key(shard: ShardFile, block: int) -> tuple[str, int, bytes]:
    """What names a checked block: where it is, its number and its checksum (a shard rewritten in place
    under another index is never served from the blocks kept of the old one)."""
    return shard.location, block, _expected(shard, block)


def _expected(shard: ShardFile, block: int) -> bytes:
    """The CRC32C the index holds for `shard`'s block `block` (4 big-endian bytes)."""
    return shard.blocks[1][4 * block: 4 * block + 4]


def _cut(shard: ShardFile, start: int, stop: int, blocks: dict[tuple[str, int, bytes], bytes]) -> bytes:
    """The file bytes [start, stop) of `shard`, cut from its checked blocks."""
    size, offset = shard.blocks[0], len(shard.header)
    parts = []
    for _, k in _blocks_of(shard, start, stop):
        base = offset + k * size
        data = blocks[_key(shard, k)]
        parts.append(data[max(start, base) - base: min(stop, base + len(data)) - base])
    return b"".join(parts)


_CHECKED = _CheckedBlocks()


def open_files() -> int:
    """Descriptors of local shards this process holds open (bounded by `MAX_OPEN_FILES`)."""
    return _LOCAL.open_count()
