"""One prepared source as an endless, per-epoch reshuffled stream of Megatron-style L+1-token examples.

Example i of a source cuts `tokens[i*L : i*L + L + 1]` into L inputs and the L targets one position
later, so the next example starts at the last token of this one: every token but the stream's first is a
target exactly once per epoch and no token boundary is lost. When the stream length is not 1 + a multiple
of L, the last example of the epoch is shorter and padded; `mask` is 0 on the padding.

The example order is reshuffled every epoch from a seed derived from (seed, source name, epoch), so the
example at any position of the stream is a pure function of those and of the position.

A prepared directory (local or gs://) is untrusted input: the index (or a single-file source's metadata)
is read with the bounded JSON reader and every field used is type- and range-checked, shard names must
be the ones prepare-data writes (nothing outside the directory), and each shard is checked against the
index before use (`token_store`). The token stream is read by positioned reads, never `np.load`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.locations import is_remote
from upcycler.train.data.format import (
    FORMAT_VERSION,
    INDEX_SUFFIX,
    META_SUFFIX,
    SHARDED_FORMAT_VERSION,
    TOKEN_DTYPES,
    TOKENS_SUFFIX,
    block_count,
    npy_header,
    shard_header,
)
from upcycler.train.data.token_store import ShardFile, TokenStream
from upcycler.untrusted import MAX_JSON_BYTES, describe, integer, load_json_object, parse_json, shown_path

if TYPE_CHECKING:
    import grain

MATERIALISE_BELOW = 1 << 20
MAX_SHARDS = 1 << 20
_FIX = "re-run upcycle prepare-data"
_SHARD_NAME = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)\.shards/\d{5,9}\.tokens")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class TokenSource:
    """A prepared source: its token stream, its index (or metadata), and where that index is."""

    name: str
    tokens: TokenStream
    meta: dict
    path: str | None = None

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer"]["sha256"]


def open_source(directory, name: str) -> TokenSource:
    """Source `name` of the prepared `directory` (a local path or gs:// location), checked against its
    index (`NAME.index.json`) or, for a single-file source of earlier versions, its `NAME.meta.json`."""
    root = str(directory).rstrip("/")
    files = _Directory(root)
    index, meta = f"{root}/{name}{INDEX_SUFFIX}", f"{root}/{name}{META_SUFFIX}"
    if files.exists(index):
        found = files.json(index)
        stream = _sharded_stream(found, root, name, shown_path(index))
        stream.verify()
        return TokenSource(name, stream, found, index)
    if files.exists(meta):
        found = files.json(meta)
        dtype, count = _check_meta(found, shown_path(meta), FORMAT_VERSION)
        stream = TokenStream([ShardFile(f"{root}/{name}{TOKENS_SUFFIX}", npy_header(dtype, count), count,
                                        dtype.itemsize, meta.rsplit("/", 1)[-1])], dtype)
        stream.verify()
        return TokenSource(name, stream, found, f"{root}/{name}{TOKENS_SUFFIX}")
    prepared = prepared_names(directory)
    raise UpcyclerError(
        f"{shown_path(index)}: no prepared source {name!r} (found: {', '.join(prepared) or 'none'}); "
        f"run `upcycle prepare-data --source {name}=FILES --out {shown_path(root)}`"
    )


def prepared_names(directory) -> list[str]:
    """The names of the sources prepared in `directory` (sharded, or single-file of earlier versions), sorted."""
    suffixes = (INDEX_SUFFIX, META_SUFFIX)
    names = _Directory(str(directory).rstrip("/")).names()
    return sorted({n[: -len(s)] for n in names for s in suffixes if n.endswith(s) and "/" not in n})


class _Directory:
    """The few reads `open_source` makes of a prepared directory, local or in a bucket."""

    def __init__(self, root: str):
        self.root = root
        self.remote = is_remote(root)

    def exists(self, path: str) -> bool:
        if self.remote:
            from upcycler.io import object_store

            return object_store.object_info(path) is not None
        return os.path.lexists(path)

    def json(self, path: str) -> dict:
        if not self.remote:
            return load_json_object(Path(path), fix=_FIX, what="prepared-source index")
        from upcycler.io import object_store

        info = object_store.object_info(path)
        if info is None or info.size > MAX_JSON_BYTES:
            raise UpcyclerError(f"{shown_path(path)}: missing or larger than {MAX_JSON_BYTES:,} bytes; {_FIX}")
        value = parse_json(object_store.read_bytes(path), shown_path(path), _FIX)
        if not isinstance(value, dict):
            raise UpcyclerError(f"{shown_path(path)}: not a JSON object; {_FIX}")
        return value

    def names(self) -> list[str]:
        if self.remote:
            from upcycler.io import object_store

            return list(object_store.list_objects(self.root))
        return [p.name for p in Path(self.root).iterdir()] if Path(self.root).is_dir() else []


def _check_meta(meta: dict, where: str, version_expected: int) -> tuple[np.dtype, int]:
    """The token dtype and count `meta` promises, after checking every field the pipeline uses."""
    version = meta.get("format_version")
    if isinstance(version, bool) or version != version_expected:
        raise UpcyclerError(
            f"{where}: unreadable prepared source (format_version {describe(version)}, "
            f"expected {version_expected}); {_FIX}"
        )
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise UpcyclerError(
            f"{where}: unreadable prepared source (dtype {describe(meta.get('dtype'))}, expected one of "
            f"{', '.join(TOKEN_DTYPES)}); {_FIX}"
        )
    dtype = np.dtype(meta["dtype"])
    count = integer(meta.get("num_tokens"), "num_tokens", where, low=1, high=1 << 48, fix=_FIX)
    most = int(np.iinfo(dtype).max) + 1
    vocab = integer(meta.get("vocab_size"), "vocab_size", where, low=1, high=most, fix=_FIX)
    integer(meta.get("eos_id"), "eos_id", where, low=0, high=vocab - 1, fix=_FIX)
    tokenizer = meta.get("tokenizer")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("sha256"), str):
        raise UpcyclerError(f"{where}: unreadable prepared source (no tokenizer sha256); {_FIX}")
    return dtype, count


def _sharded_stream(index: dict, root: str, name: str, where: str) -> TokenStream:
    """The stream of a sharded source, each shard checked to be named and counted as its index says."""
    dtype, count = _check_meta(index, where, SHARDED_FORMAT_VERSION)
    shards = index.get("shards")
    if not isinstance(shards, list) or not 0 < len(shards) <= MAX_SHARDS:
        raise UpcyclerError(f"{where}: unreadable prepared source (no shard list); {_FIX}")
    block_bytes = None
    if "block_bytes" in index:
        block_bytes = integer(index["block_bytes"], "block_bytes", where, low=4096, high=1 << 30, fix=_FIX)
    files = []
    for k, shard in enumerate(shards):
        at = f"{where}: shards[{k}]"
        file = shard.get("file") if isinstance(shard, dict) else None
        match = _SHARD_NAME.fullmatch(file) if isinstance(file, str) else None
        if match is None or match["name"] != name:
            raise UpcyclerError(f"{at}: file {describe(file)} is not a shard of {name!r}; {_FIX}")
        tokens = integer(shard.get("tokens"), "tokens", at, low=1, high=1 << 48, fix=_FIX)
        documents = integer(shard.get("documents"), "documents", at, low=0, high=1 << 48, fix=_FIX)
        digest = shard.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise UpcyclerError(f"{at}: sha256 {describe(digest)} is not a hex digest; {_FIX}")
        files.append(ShardFile(f"{root}/{file}", shard_header(dtype, tokens, documents, digest), tokens,
                               dtype.itemsize, where.rsplit("/", 1)[-1],
                               _block_checksums(shard, tokens * dtype.itemsize, block_bytes, at)))
    if sum(f.tokens for f in files) != count:
        raise UpcyclerError(f"{where}: the shards hold {sum(f.tokens for f in files):,} tokens, num_tokens says "
                            f"{count:,}; {_FIX}")
    return TokenStream(files, dtype)


def _block_checksums(shard: dict, token_bytes: int, block_bytes: int | None, at: str) -> tuple[int, bytes] | None:
    """(block size, the shard's `block_crc32c` decoded: 4 bytes per block), or None for an index written
    before blocks were checksummed; a value that does not fit the shard is refused."""
    text = shard.get("block_crc32c")
    if text is None and block_bytes is None:
        return None
    try:
        raw = base64.b64decode(text, validate=True) if isinstance(text, str) and block_bytes else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != 4 * block_count(token_bytes, block_bytes):
        raise UpcyclerError(f"{at}: block_crc32c {describe(text)} does not hold one checksum per "
                            f"{describe(block_bytes)}-byte block of its {token_bytes:,} token bytes; {_FIX}")
    return block_bytes, raw


class Windows:
    """Random access to the examples of one epoch in stream order: `windows[i] -> (inputs, targets, mask)`."""

    def __init__(self, tokens: np.ndarray, seq_len: int, pad_id: int):
        if tokens.shape[0] < seq_len + 1:
            raise ValueError(f"{tokens.shape[0]} tokens is fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return (self.tokens.shape[0] - 1 + self.seq_len - 1) // self.seq_len

    def span(self, i: int) -> tuple[int, int]:
        """The [start, stop) token range of window i (L+1 tokens, fewer for the epoch's last)."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        return start, min(start + self.seq_len + 1, self.tokens.shape[0])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """inputs_L and targets_L (int32) and mask_L (float32, 1 where the target is real)."""
        start, stop = self.span(i)
        return self.example(self.tokens[start:stop])

    def example(self, piece: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A window's tokens (`span`) cut into inputs, targets and mask."""
        piece = np.asarray(piece, dtype=np.int32)
        real = piece.shape[0] - 1
        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        targets = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        inputs[:real] = piece[:-1]
        targets[:real] = piece[1:]
        mask = np.zeros(self.seq_len, dtype=np.float32)
        mask[:real] = 1.0
        return inputs, targets, mask


def derive_seed(*parts: object, bits: int = 64) -> int:
    """A `bits`-bit seed determined by `parts` alone; distinct parts give unrelated seeds."""
    digest = hashlib.sha256(b"upcycler.data/" + "/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[: bits // 8], "little")


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed bijection of uint64 values that scrambles every bit."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def stable_permutation(n: int, seed: int) -> np.ndarray:
    """A permutation of range(n) fixed by (n, seed) alone: plain integer arithmetic, so no library
    upgrade changes it (numpy's `Generator` streams may change between versions)."""
    offset = _mix64(np.array([seed % 2**64], dtype=np.uint64))
    return np.argsort(_mix64(np.arange(n, dtype=np.uint64) + offset), kind="stable")


class ExampleStream:
    """Source examples repeated forever: example j is window `order_k[j % n]` of epoch k = j // n.

    `order_k` is a permutation of range(n) seeded by (seed, name, k), or the identity if `shuffle` is
    False, so every window appears exactly once per epoch. Epochs of fewer than `materialise_below`
    windows hold their order as an int32 array; larger ones use Grain's index
    shuffle, which needs no memory but costs about 10 us per lookup.
    """

    def __init__(
        self,
        windows: Windows,
        name: str,
        seed: int,
        shuffle: bool = True,
        materialise_below: int = MATERIALISE_BELOW,
    ):
        self.windows = windows
        self.name = name
        self.seed = seed
        self.shuffle = shuffle
        self.materialise_below = materialise_below
        self._orders: dict[int, np.ndarray | grain.MapDataset] = {}
        self._lock = threading.Lock()

    @property
    def epoch_size(self) -> int:
        return len(self.windows)

    def window_index(self, j: int) -> int:
        """Which window of its epoch example j of the stream is."""
        epoch, position = divmod(j, self.epoch_size)
        return int(self._order(epoch)[position]) if self.shuffle else position

    def __getitem__(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.windows[self.window_index(j)]

    def span(self, j: int) -> tuple[int, int]:
        """The token range of example j of the stream (see `Windows.span`)."""
        return self.windows.span(self.window_index(j))

    def _order(self, epoch: int) -> np.ndarray | grain.MapDataset:
        """Epoch `epoch`'s permutation; the previous epoch's stays cached for batches that straddle both."""
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                seed = derive_seed(self.seed, self.name, epoch, bits=32)
                if self.epoch_size < self.materialise_below:
                    order = stable_permutation(self.epoch_size, seed).astype(np.int32)
                else:
                    import grain  # imported when first needed: opening a source stays light

                    order = grain.MapDataset.range(self.epoch_size).shuffle(seed=seed)
                kept = {k: v for k, v in self._orders.items() if k == epoch - 1}
                self._orders = {**kept, epoch: order}
            return order
