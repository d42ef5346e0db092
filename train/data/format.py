"""The on-disk formats of a prepared-data directory, shared by its writer (`prepare`) and readers (`sources`).

**Sharded sources** (format 2, what `prepare-data` writes). Per named source:
- `NAME.shards/NNNNN.tokens` (`shard_file`): the tokens of one unit of input (a run of small files or a
  byte range of a large one, `plan.py`), documents in input order, each followed by the EOS id, as
  little-endian `token_dtype(vocab_size)` after a `SHARD_HEADER_BYTES` header (`shard_header`) that
  records the dtype, the token and document counts and the sha256 of the token bytes. A reader compares
  the header with the one the index implies byte for byte, so a shard that was swapped, truncated,
  extended or replaced is refused before a token of it is used.
- `NAME.index.json` (`INDEX_SUFFIX`), written last (the commit: a source is complete exactly when its
  index exists): `format_version` 2, `name`, `dtype`, `num_tokens`, `num_documents`, `vocab_size`,
  `eos_id`, `tokenizer` {`file`, `sha256`}, `input` (the reading options), `files` [{`path`, `bytes`,
  `sha256`}], `block_bytes` (`BLOCK_BYTES`) and `shards` [{`file`, `tokens`, `documents`, `sha256`,
  `block_crc32c`}] in stream order. `block_crc32c` is the CRC32C of each `block_bytes` block of the
  shard's token bytes (the header excluded; the last block may be shorter), each as 4 big-endian bytes,
  all concatenated and written in base64 (`BlockChecksums`): a reader checks every block it reads, so a
  token damaged on the way from a bucket (or on a disk) is read again or refused, never trained on.
  Indexes written before `block_crc32c` existed have neither field; their shards are read unchecked.

**Held-out split** (`prepare-data --heldout FRACTION`, FRACTION in (0, 1)). Source NAME is written as two
sharded sources: `NAME.heldout` (`heldout_name`) holds the documents that `held_out` picks and NAME the
rest, in input order. Both indexes add `split` ("train" or "heldout") and `heldout_fraction`; without a
split neither field is written. A document is held out when the first 8 bytes of the sha256 of its token
ids (without the EOS that ends it, as little-endian uint32), read as a little-endian integer h, satisfy
h < FRACTION * 2**64: a property of the document's content alone, so a duplicate falls on the side of its
original, and the split is the same for any runner, worker count, unit cut, input format and source.

**Single-file sources** (format 1, written by earlier versions; still read). Per named source:
- `NAME.tokens.npy` (`TOKENS_SUFFIX`): a 1-D array of `token_dtype(vocab_size)` behind a version-1.0
  `.npy` header that is always `NPY_HEADER_BYTES` long (`npy_header`);
- `NAME.meta.json` (`META_SUFFIX`), written last: the fields of the index above without `shards`, plus
  `tokens_file`.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct

import google_crc32c
import numpy as np

FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2
TOKENS_SUFFIX = ".tokens.npy"
META_SUFFIX = ".meta.json"
INDEX_SUFFIX = ".index.json"
SHARDS_SUFFIX = ".shards"
HELDOUT_SUFFIX = ".heldout"
NPY_HEADER_BYTES = 128
SHARD_HEADER_BYTES = 128
SHARD_MAGIC = b"UPCYCLER-TOKENS\n"
TOKEN_DTYPES = ("uint16", "uint32")
BLOCK_BYTES = 1 << 18  # token bytes per checksummed block of a shard (see the module docstring)
_SHARD_FIELDS = struct.Struct("<16sIIQQ32s")  # magic, format, itemsize, tokens, documents, sha256


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def npy_header(dtype: np.dtype, count: int) -> bytes:
    """A version-1.0 `.npy` header for a 1-D array, always `NPY_HEADER_BYTES` long so it can be rewritten."""
    text = repr({"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (count,)}).encode("latin1")
    size = NPY_HEADER_BYTES - 10
    return b"\x93NUMPY\x01\x00" + size.to_bytes(2, "little") + text + b" " * (size - len(text) - 1) + b"\n"


def shard_file(name: str, index: int) -> str:
    """The path of shard `index` of source `name`, relative to the prepared directory."""
    return f"{name}{SHARDS_SUFFIX}/{index:05d}.tokens"


def shard_header(dtype: np.dtype, tokens: int, documents: int, sha256: str) -> bytes:
    """The `SHARD_HEADER_BYTES` header of a shard holding `tokens` ids of `dtype` whose bytes hash to `sha256`."""
    packed = _SHARD_FIELDS.pack(SHARD_MAGIC, SHARDED_FORMAT_VERSION, np.dtype(dtype).itemsize, tokens,
                                documents, bytes.fromhex(sha256))
    return packed + b"\0" * (SHARD_HEADER_BYTES - len(packed))


def heldout_name(name: str) -> str:
    """The name of source `name`'s held-out split."""
    return f"{name}{HELDOUT_SUFFIX}"


def held_out(ids: np.ndarray, ends: np.ndarray, fraction: float) -> np.ndarray:
    """Which of the documents `ids[ends[k-1]:ends[k]]` (each ending with its EOS) the split of `fraction`
    holds out (see the module docstring): a bool per document."""
    threshold = math.ceil(fraction * 2**64)  # exact: h / 2**64 < fraction  <=>  h < ceil(fraction * 2**64)
    words = np.asarray(ids).astype("<u4")
    starts = np.concatenate(([0], ends[:-1]))
    return np.fromiter((int.from_bytes(hashlib.sha256(words[start:end - 1]).digest()[:8], "little") < threshold
                        for start, end in zip(starts.tolist(), np.asarray(ends).tolist())),
                       dtype=bool, count=len(ends))


class BlockChecksums:
    """The CRC32C of each `block_bytes` block of a stream of token bytes fed in pieces of any size, written
    as an index's `block_crc32c` holds them (`text`)."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self._done = bytearray()  # 4 big-endian bytes per finished block
        self._current = google_crc32c.Checksum()
        self._filled = 0

    def update(self, data: bytes) -> None:
        at = 0
        while at < len(data):
            take = min(len(data) - at, self.block_bytes - self._filled)
            self._current.update(bytes(data[at:at + take]))
            self._filled += take
            at += take
            if self._filled == self.block_bytes:
                self._done += self._current.digest()
                self._current, self._filled = google_crc32c.Checksum(), 0

    def text(self) -> str:
        """Base64 of every block's checksum, the last (shorter) block's too."""
        tail = self._current.digest() if self._filled else b""
        return base64.b64encode(bytes(self._done) + tail).decode()


def block_count(token_bytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """How many blocks `token_bytes` bytes of tokens make."""
    return -(-token_bytes // block_bytes)


def block_crc32c(data: bytes) -> bytes:
    """The CRC32C of one block as `block_crc32c` holds it: 4 big-endian bytes."""
    return google_crc32c.value(data).to_bytes(4, "big")
