"""One prepared source as an endless, per-epoch reshuffled stream of Megatron-style L+1-token examples.

Example i of a source cuts `tokens[i*L : i*L + L + 1]` into L inputs and the L targets one position
later, so the next example starts at the last token of this one: every token but the stream's first is a
target exactly once per epoch and no token boundary is lost. When the stream length is not 1 + a multiple
of L, the last example of the epoch is shorter and padded; `mask` is 0 on the padding.

The example order is reshuffled every epoch from a seed derived from (seed, source name, epoch), so the
example at any position of the stream is a pure function of those and of the position.

A prepared directory is untrusted input: the metadata is read with the bounded JSON reader and every
field used is type- and range-checked; the token file must be a regular file starting with exactly the
`.npy` header prepare-data writes for that dtype and count, and be exactly as long as it says. It is
then memory-mapped read-only at a known offset (never `np.load`: no pickles, no `.npz`, no other dtypes).
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.data.format import (
    FORMAT_VERSION,
    META_SUFFIX,
    NPY_HEADER_BYTES,
    TOKEN_DTYPES,
    TOKENS_SUFFIX,
    npy_header,
)
from upcycler.untrusted import describe, integer, load_json_object, open_regular, shown_path

if TYPE_CHECKING:
    import grain

MATERIALISE_BELOW = 1 << 20
_FIX = "re-run upcycle prepare-data"


@dataclass(frozen=True)
class TokenSource:
    """A prepared source: its memory-mapped token stream, its metadata and the token file's path."""

    name: str
    tokens: np.ndarray
    meta: dict
    path: Path | None = None

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer"]["sha256"]


def open_source(directory: Path, name: str) -> TokenSource:
    """Memory-map `directory/NAME.tokens.npy`, checked against `NAME.meta.json`."""
    meta_path = directory / f"{name}{META_SUFFIX}"
    tokens_path = directory / f"{name}{TOKENS_SUFFIX}"
    if not os.path.lexists(meta_path):
        found = sorted(p.name[: -len(META_SUFFIX)] for p in directory.glob(f"*{META_SUFFIX}"))
        raise UpcyclerError(
            f"{shown_path(meta_path)}: no prepared source {name!r} (found: {', '.join(found) or 'none'}); "
            f"run `upcycle prepare-data --source {name}=FILES --out {shown_path(directory)}`"
        )
    meta = load_json_object(meta_path, fix=_FIX, what="prepared-source metadata")
    dtype, count = _check_meta(meta, shown_path(meta_path))
    return TokenSource(name, _map_tokens(tokens_path, meta_path, dtype, count), meta, tokens_path)


def _check_meta(meta: dict, where: str) -> tuple[np.dtype, int]:
    """The token dtype and count `meta` promises, after checking every field the pipeline uses."""
    version = meta.get("format_version")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise UpcyclerError(
            f"{where}: unreadable prepared source (format_version {describe(version)}, "
            f"expected {FORMAT_VERSION}); {_FIX}"
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


def _map_tokens(path: Path, meta_path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """The `count` tokens of `path`, memory-mapped read-only, if it is exactly what prepare-data wrote."""
    with os.fdopen(open_regular(path, "token file"), "rb") as f:
        try:
            header = f.read(NPY_HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
        except OSError as err:
            raise UpcyclerError(f"{shown_path(path)}: cannot read ({err.strerror}); {_FIX}") from None
        if header != npy_header(dtype, count):
            raise UpcyclerError(
                f"{shown_path(path)}: does not match {meta_path.name} (not the {dtype.name} array of {count} "
                f"tokens it describes: replaced or corrupt); {_FIX}"
            )
        expected = NPY_HEADER_BYTES + count * dtype.itemsize
        if size != expected:
            raise UpcyclerError(
                f"{shown_path(meta_path)}: unreadable prepared source ({path.name} holds {size:,} bytes, "
                f"expected {expected:,}: truncated or extended); {_FIX}"
            )
        try:
            return np.memmap(f, dtype=dtype, mode="r", offset=NPY_HEADER_BYTES, shape=(count,))
        except (OSError, ValueError) as err:
            raise UpcyclerError(f"{shown_path(path)}: cannot map it ({err}); {_FIX}") from None


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

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """inputs_L and targets_L (int32) and mask_L (float32, 1 where the target is real)."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        piece = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)
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
