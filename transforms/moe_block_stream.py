"""One MoE layer's side of the in-stream write check (`moe_write_check`), streamed from its dense MLP.

The layer's dense gate_proj, up_proj and down_proj are each read once, a chunk of rows at a time into
reused buffers (`pread` from the source file, not mapped): the check's memory is a few MiB at any model
size. Each chunk yields, in the same pass:

- the digest each distinct expert window and the shared expert must have: gate and up rows as stored
  (or widened to the output dtype), down_proj columns times their scale, by adding to bf16 exponents
  where that is the exact product (every exponent normal and staying in range), else computed as the
  transform computes it (`scale_columns`);
- the dense MLP on the probe vectors in fp32, down_proj's sum over the neurons kept piece by piece
  (pieces of at most `PIECE` neurons that never cross a window's edge), so that the dense output, the
  same sum in another order (the noise floor) and each window's part of it come from one pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import xxhash

from upcycler.errors import UpcyclerError
from upcycler.tensors import BF16, LazyTensor
from upcycler.transforms.dense_to_moe import scale_columns
from upcycler.transforms.expert_cover import Cover, powers_of_two
from upcycler.untrusted import shown_path

PIECE = 512  # neurons per piece of down_proj's sum (the noise floor reverses the pieces' order)
CHUNK_BYTES = 2 << 20  # source bytes read and converted at a time


@dataclass
class LayerSums:
    """What one pass over a layer's dense MLP gives the probe: per piece of neurons, the dense down_proj's
    partial sum on the probes, and (overlapping windows only) each window's scaled part."""

    pieces: list[slice]
    partial: np.ndarray  # [pieces, P, D]: Σ over the piece's neurons of h_n · down[:, n]
    window_parts: list[np.ndarray] | None  # [P, D] per window with its column scales; None when windows tile


class Buffers:
    """Reused scratch arrays, one per purpose, grown as needed: no fresh pages per chunk or layer."""

    def __init__(self) -> None:
        self._held: dict[str, np.ndarray] = {}

    def get(self, purpose: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        size = int(np.prod(shape))
        held = self._held.get(purpose)
        if held is None or held.size < size or held.dtype != np.dtype(dtype):
            # zeros: the bf16 widening writes high halves only and relies on the low halves staying zero
            held = self._held[purpose] = np.zeros(size, dtype)
        return held[:size].reshape(shape)


def row_chunks(tensor: LazyTensor, ranges: list[tuple[int, int]], buffers: Buffers) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) of a 2-D source tensor's row ranges, in order, a chunk of about `CHUNK_BYTES` at a
    time: read from its file into one reused buffer when the tensor is stored there, else sliced from its
    loaded values. Each chunk is valid until the next."""
    cols = tensor.shape[1]
    dtype = np.dtype(tensor.dtype)
    row_bytes = cols * dtype.itemsize
    step = max(1, CHUNK_BYTES // row_bytes)
    stored = tensor.stored
    values = None if stored is not None else np.asarray(tensor.load())
    fd = os.open(stored.path, os.O_RDONLY) if stored is not None else None
    try:
        for start, stop in ranges:
            for r0 in range(start, stop, step):
                r1 = min(stop, r0 + step)
                if values is not None:
                    yield r0, values[r0:r1]
                    continue
                chunk = buffers.get("read", (r1 - r0, cols), dtype)
                want = (r1 - r0) * row_bytes
                got = os.preadv(fd, [memoryview(chunk.reshape(-1).view(np.uint8))], stored.offset + r0 * row_bytes)
                if got != want:
                    raise UpcyclerError(f"{shown_path(stored.path)}: ends before the tensor it declares; "
                                        "re-download the source")
                yield r0, chunk
    finally:
        if fd is not None:
            os.close(fd)


def widen(values: np.ndarray, buffers: Buffers, purpose: str = "fp32") -> np.ndarray:
    """`values` in fp32 (exact for bf16, fp16 and fp32; rounded for fp64) in a reused buffer: a bf16
    value's bits are its fp32 bits' high half, so bf16 is one strided copy over zeroed low halves."""
    if values.dtype == BF16:
        out = buffers.get(purpose + "/bf16", values.shape, np.float32)
        np.copyto(out.view(np.uint16)[..., 1::2], values.view(np.uint16))
        return out
    out = buffers.get(purpose, values.shape, np.float32)
    np.copyto(out, values, casting="unsafe")
    return out


def pieces_of(cover: Cover) -> list[slice]:
    """The dense FFN's neurons in runs of at most `PIECE` that never cross the shared part's or a (sliced)
    window's edge."""
    edges = {0, cover.shared, cover.intermediate}
    for j in range(cover.group):
        window = cover.window(j)
        if isinstance(window, slice):
            edges |= {window.start, window.stop}
    cuts = sorted(edges)
    return [slice(s, min(s + PIECE, b)) for a, b in pairwise(cuts) for s in range(a, b, PIECE)]


def row_window_digests(tensor: LazyTensor, x: np.ndarray, cover: Cover, out_dtype: np.dtype,
                       buffers: Buffers) -> tuple[np.ndarray, list[str], str]:
    """For a dense [F, D] gate_proj or up_proj: (x @ Wᵀ in fp32 [P, F]; the digest of each window's rows in
    `out_dtype`; the shared expert's rows' digest, '' without one)."""
    F = tensor.shape[0]
    out = np.empty((len(x), F), np.float32)
    xt = np.ascontiguousarray(x.T)  # W @ xᵀ: one BLAS pass over W's rows, faster than x @ Wᵀ for few probes
    windows = [cover.window(j) for j in range(cover.group)]
    runs = [(w.start, w.stop) if isinstance(w, slice) else None for w in windows]
    if cover.shared:
        runs.append((0, cover.shared))
    hashers = [xxhash.xxh3_128() for _ in runs]
    for r0, chunk in row_chunks(tensor, [(0, F)], buffers):
        r1 = r0 + len(chunk)
        out[:, r0:r1] = (widen(chunk, buffers) @ xt).T
        for run, hasher in zip(runs, hashers):
            if run is not None and run[0] < r1 and r0 < run[1]:
                hasher.update(_bytes(chunk[max(run[0], r0) - r0:min(run[1], r1) - r0], out_dtype))
    digests = [h.hexdigest() for h in hashers]
    for j, window in enumerate(windows):  # a window that wraps: its two runs of rows, in its order
        if not isinstance(window, slice):
            hasher = xxhash.xxh3_128()
            first = int(window[0])
            ranges = [(first, cover.intermediate), (cover.shared, int(window[-1]) + 1)]
            for _, chunk in row_chunks(tensor, ranges, buffers):
                hasher.update(_bytes(chunk, out_dtype))
            digests[j] = hasher.hexdigest()
    return out, digests[:cover.group], digests[cover.group] if cover.shared else ""


def column_window_digests(tensor: LazyTensor, h: np.ndarray, cover: Cover, scales: list, double: float,
                          scaled_dtype: np.dtype, out_dtype: np.dtype,
                          buffers: Buffers) -> tuple[LayerSums, list[str], str]:
    """For the dense [D, F] down_proj: (the probe's sums, `LayerSums`; the digest of each window's columns
    times its scale (`scales[j]`: one factor, or one per column), in `scaled_dtype` then `out_dtype`; the
    shared expert's columns times `double`, '' without one)."""
    D = tensor.shape[0]
    pieces = pieces_of(cover)
    tiled = cover.overlap == 0 and all(isinstance(cover.window(j), slice) for j in range(cover.group))
    partial = np.zeros((len(pieces), len(h), D), np.float32)
    parts = None if tiled else [np.zeros((len(h), D), np.float32) for _ in range(cover.group)]
    windows = [cover.window(j) for j in range(cover.group)]
    scaled_h = None if tiled else [h[:, w] * np.asarray(s, np.float32) for w, s in zip(windows, scales)]
    hashers = [xxhash.xxh3_128() for _ in range(cover.group + 1)]
    for r0, chunk in row_chunks(tensor, [(0, D)], buffers):
        r1 = r0 + len(chunk)
        wide = widen(chunk, buffers)
        for q, n in enumerate(pieces):
            partial[q][:, r0:r1] = h[:, n] @ wide[:, n].T
        for j, (window, scale) in enumerate(zip(windows, scales)):
            if parts is not None:
                parts[j][:, r0:r1] = scaled_h[j] @ wide[:, window].T
            hashers[j].update(_scaled_bytes(chunk, window, scale, scaled_dtype, out_dtype, buffers))
        if cover.shared:
            hashers[-1].update(_bytes(scale_columns(np.ascontiguousarray(chunk[:, :cover.shared]), double), out_dtype))
    digests = [hasher.hexdigest() for hasher in hashers]
    return LayerSums(pieces, partial, parts), digests[:cover.group], digests[-1] if cover.shared else ""


def _bytes(values: np.ndarray, dtype: np.dtype) -> memoryview:
    """The C-order bytes of `values` in `dtype` (no copy when already so)."""
    return memoryview(np.ascontiguousarray(values.astype(dtype, copy=False)).reshape(-1).view(np.uint8))


def _scaled_bytes(chunk: np.ndarray, window: slice | np.ndarray, scale, scaled_dtype: np.dtype,
                  out_dtype: np.dtype, buffers: Buffers) -> memoryview:
    """The bytes the transform writes for columns `window` of these down_proj rows times `scale`."""
    if (chunk.dtype == BF16 and scaled_dtype == BF16 == out_dtype and np.isscalar(scale)
            and isinstance(window, slice) and powers_of_two([float(scale)])):
        exact = _bf16_times_power_of_two(chunk[:, window], int(np.log2(float(scale))), buffers)
        if exact is not None:
            return memoryview(exact.reshape(-1).view(np.uint8))
    return _bytes(scale_columns(np.ascontiguousarray(chunk[:, window]), scale, scaled_dtype), out_dtype)


def _bf16_times_power_of_two(values: np.ndarray, k: int, buffers: Buffers) -> np.ndarray | None:
    """bf16 `values` × 2^k by adding k to every exponent field, or None where that is not the exact
    product: a zero, subnormal, infinity or NaN among them, or an exponent leaving the normal range."""
    bits = values.view(np.uint16)
    exponent = buffers.get("exponent", bits.shape, np.uint16)
    np.bitwise_and(bits, 0x7F80, out=exponent)
    low, high = int(exponent.min()) >> 7, int(exponent.max()) >> 7
    if not (1 <= low and high <= 254 and 1 <= low + k and high + k <= 254):
        return None
    moved = buffers.get("moved", bits.shape, np.uint16)
    np.add(bits, np.uint16((k << 7) & 0xFFFF), out=moved)  # modulo 2^16: the sign bit is never reached
    return moved
