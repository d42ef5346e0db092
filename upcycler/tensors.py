"""Lazy tensors and the TensorMap every reader, transform and writer speaks.

A `LazyTensor` knows its shape and dtype without reading a byte; its values are produced only when a
writer calls `load()` (the whole tensor) or `part(i)` (index `i` of the leading axis, e.g. one expert of
a stacked expert tensor, so a 64-expert output never holds 64 experts at once). A tensor read unchanged
from a file also says where its bytes are (`stored`, `stored_part(i)`), so a writer can stream them
into its output in small reused buffers instead of loading the whole array. Transforms build new
lazy tensors from old ones with `derive`, `stack` and `constant`; nothing is computed until written.

Dtypes are numpy dtypes; bfloat16 comes from `ml_dtypes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TypeVar

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES: dict[str, np.dtype] = {
    "bf16": BF16,
    "bfloat16": BF16,
    "fp16": np.dtype(np.float16),
    "float16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
    "float32": np.dtype(np.float32),
}


def parse_dtype(name: str) -> np.dtype:
    """Map a user-facing dtype name (bf16, fp16, fp32, …) to a numpy dtype."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from None


def dtype_name(dtype: np.dtype) -> str:
    return {BF16: "bfloat16", np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}.get(
        np.dtype(dtype), np.dtype(dtype).name
    )


@dataclass(frozen=True)
class StoredBytes:
    """Where a tensor's exact C-order bytes are stored: `nbytes` bytes at `offset` of the file `path`.

    `seen(offset, data)`, when set, must be told of every range read from it (the source's digest watch).
    """

    path: Path
    offset: int
    nbytes: int
    seen: Callable[[int, memoryview], None] | None = None

    def row(self, index: int, rows: int) -> StoredBytes:
        """Row `index` of the `rows` equal rows these bytes hold (index `index` of the leading axis)."""
        return self.rows(slice(index, index + 1), rows)

    def rows(self, window: slice, rows: int) -> StoredBytes:
        """Rows `window` (a step-1 slice within range) of the `rows` equal rows these bytes hold: one
        contiguous range, as C order stores them."""
        size = self.nbytes // rows
        return StoredBytes(self.path, self.offset + window.start * size, (window.stop - window.start) * size,
                           self.seen)


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor whose values are computed or read only on demand.

    `stored` (the whole tensor) or `stored_parts` (each part) say where its exact bytes are, when they are
    a file's bytes unchanged; anything derived from it is a new tensor without them.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    _load: Callable[[], np.ndarray]
    _part: Callable[[int], np.ndarray] | None = None
    stored: StoredBytes | None = None
    stored_parts: tuple[StoredBytes, ...] | None = None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize

    def load(self) -> np.ndarray:
        """All values, as a C-contiguous array of `shape` and `dtype`."""
        arr = np.ascontiguousarray(self._load())
        _check(arr, self.shape, self.dtype, "load")
        return arr

    def part(self, index: int) -> np.ndarray:
        """`load()[index]`, computed without producing the rest of the tensor when possible."""
        if not 0 <= index < self.shape[0]:
            raise IndexError(f"part {index} of a tensor with leading dimension {self.shape[0]}")
        arr = self._part(index) if self._part is not None else self._load()[index]
        arr = np.ascontiguousarray(arr)
        _check(arr, self.shape[1:], self.dtype, "part")
        return arr

    def stored_part(self, index: int) -> StoredBytes | None:
        """Where `part(index)`'s exact bytes are stored, if they are stored unchanged."""
        if self.stored_parts is not None:
            return self.stored_parts[index]
        return self.stored.row(index, self.shape[0]) if self.stored is not None and self.shape else None

    def stored_rows(self, window: slice | np.ndarray) -> StoredBytes | None:
        """Where `load()[window]`'s exact bytes are stored, if they are stored unchanged: a step-1 slice of
        the leading axis of a stored tensor (index arrays, strided slices: None)."""
        if self.stored is None or not self.shape or not isinstance(window, slice):
            return None
        start, stop, step = window.indices(self.shape[0])
        if step != 1 or stop <= start:
            return None
        return self.stored.rows(slice(start, stop), self.shape[0])

    def astype(self, dtype: np.dtype) -> LazyTensor:
        """The same tensor cast to `dtype` (a no-op when it already has it)."""
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return LazyTensor(
            self.shape,
            dtype,
            lambda: self.load().astype(dtype),
            lambda i: self.part(i).astype(dtype),
        )


def _check(arr: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    if arr.shape != tuple(shape) or arr.dtype != dtype:
        raise AssertionError(f"lazy tensor {what} produced {arr.shape} {arr.dtype}, declared {shape} {dtype}")


def constant(array: np.ndarray) -> LazyTensor:
    """A lazy view of an array already in memory (small tensors: routers, norms, test data)."""
    array = np.ascontiguousarray(array)
    return LazyTensor(tuple(array.shape), array.dtype, lambda: array, lambda i: array[i])


def zeros(shape: Sequence[int], dtype: np.dtype) -> LazyTensor:
    """Zeros of `shape`, allocated only when written."""
    shape = tuple(shape)
    return LazyTensor(shape, np.dtype(dtype), lambda: np.zeros(shape, dtype), lambda i: np.zeros(shape[1:], dtype))


def ones(shape: Sequence[int], dtype: np.dtype) -> LazyTensor:
    """Ones of `shape` (norm weights), allocated only when written."""
    shape = tuple(shape)
    return LazyTensor(shape, np.dtype(dtype), lambda: np.ones(shape, dtype), lambda i: np.ones(shape[1:], dtype))


def derive(
    source: LazyTensor,
    fn: Callable[[np.ndarray], np.ndarray],
    *,
    shape: Sequence[int] | None = None,
    dtype: np.dtype | None = None,
) -> LazyTensor:
    """`fn(source.load())`, lazily. Give `shape`/`dtype` when `fn` changes them."""
    out_shape = tuple(shape) if shape is not None else source.shape
    out_dtype = np.dtype(dtype) if dtype is not None else source.dtype
    return LazyTensor(out_shape, out_dtype, lambda: fn(source.load()))


def stack(parts: Sequence[Callable[[], np.ndarray]], shape: Sequence[int], dtype: np.dtype,
          stored: Sequence[StoredBytes | None] | None = None) -> LazyTensor:
    """A tensor whose `part(i)` is `parts[i]()`; `load()` stacks them all (avoid for large tensors).
    `stored`, when every part is a file's bytes unchanged, says where each one is."""
    shape = tuple(shape)
    if len(parts) != shape[0]:
        raise ValueError(f"{len(parts)} parts for a leading dimension of {shape[0]}")
    where = tuple(stored) if stored is not None and all(s is not None for s in stored) else None
    return LazyTensor(shape, np.dtype(dtype), lambda: np.stack([p() for p in parts]), lambda i: parts[i](),
                      stored_parts=where)  # type: ignore[arg-type]


class TensorMap(Mapping[str, LazyTensor]):
    """An immutable, ordered mapping from canonical tensor name to `LazyTensor`."""

    def __init__(self, tensors: Mapping[str, LazyTensor] | Sequence[tuple[str, LazyTensor]] = ()):
        self._tensors: dict[str, LazyTensor] = dict(tensors)

    def __getitem__(self, name: str) -> LazyTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"TensorMap({len(self)} tensors, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def updated(self, changes: Mapping[str, LazyTensor]) -> TensorMap:
        """A copy with `changes` added or replaced (new names go at the end)."""
        return TensorMap({**self._tensors, **changes})

    def without(self, names: Sequence[str]) -> TensorMap:
        drop = set(names)
        return TensorMap({k: v for k, v in self._tensors.items() if k not in drop})

    def astype(self, dtype: np.dtype) -> TensorMap:
        """Every floating tensor cast to `dtype`."""
        return TensorMap(
            {k: v.astype(dtype) if np.issubdtype(v.dtype, np.floating) or v.dtype == BF16 else v
             for k, v in self._tensors.items()}
        )


T = TypeVar("T")


def cut_in_order(items: Sequence[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive runs of `items` of at most `limit` total `size` each (a larger item stands alone).

    Preserves the order of the items; used to cut shards and write groups.
    """
    runs: list[list[T]] = [[]]
    total = 0
    for item in items:
        n = size(item)
        if runs[-1] and total + n > limit:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += n
    return runs


def read_ahead(readers: Sequence[Callable[[], np.ndarray]]) -> Iterator[np.ndarray]:
    """Each reader's array in order, the next one read on a worker thread while this one is used.

    Overlaps reading with the consumer's work at the cost of one more array in memory, provided the
    consumer drops each array before asking for the next.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(readers[0]) if readers else None
        for k in range(len(readers)):
            array = pending.result()
            pending = pool.submit(readers[k + 1]) if k + 1 < len(readers) else None
            yield array
            del array
