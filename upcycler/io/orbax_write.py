"""Write a `Checkpoint` as an Orbax directory (layout: `upcycler.io.orbax_layout`), streaming.

- Leaves are produced in canonical order and saved in groups of about `group_bytes` with
  `partial.save_async`, the next group read while the previous one is written, so memory holds at most
  two groups (or one tensor when a tensor is larger); `partial.finalize` merges the groups. Each group is
  hashed from memory on a worker thread while Orbax writes it, so nothing is read back. Once a group is
  written its files start writing back, and those of the group before leave the page cache
  (`io.writeback.DropBehind`).
- Everything goes to a temporary sibling that is renamed to OUT only when complete
  (`upcycler.io.staging`); a full disk gives one error and leaves nothing behind.
- Before that, `check` runs on the complete staged directory (`write_checkpoint` passes one that opens it
  with the reader, which checks that its pytree holds exactly the declared tensors with their shapes and
  dtypes, then runs the function check of a function-preserving write); a record it returns is added to
  the manifest as `verification`.
- Reading is lazy and lives in `upcycler.io.orbax_read`; the trainer reads an Orbax output through it
  (`read_checkpoint`), one tensor at a time.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.hashing import sha256_file
from upcycler.io.manifest import write_manifest
from upcycler.io.orbax_layout import CHUNK_BYTES, PARAMS
from upcycler.io.staging import staged_directory
from upcycler.io.writeback import DropBehind
from upcycler.layout import ParamDecl, account, declare_params
from upcycler.tensors import LazyTensor, TensorMap, cut_in_order, dtype_name

DEFAULT_GROUP_BYTES = 512 * 1024**2


def write_orbax(
    ckpt: Checkpoint,
    out: Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    extra_manifest: dict | None = None,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    check: Callable[[Path], dict | None] | None = None,
) -> Path:
    """Write `ckpt` to `out` in the layout above and return `out`.

    Preserves every tensor bit for bit (shape, dtype and bytes; casts happen before, in the TensorMap),
    the spec and the lineage (in the manifest) and the side files.
    """
    out = Path(out).absolute()  # Orbax requires absolute destinations
    account(ckpt.spec, ckpt.tensors)
    decls = declare_params(ckpt.spec)
    groups = _groups(decls, ckpt.tensors, group_bytes)
    with staged_directory(out, overwrite=overwrite, sources=ckpt.inputs) as tmp:
        try:
            digests = _save_params(tmp / PARAMS, ckpt.tensors, groups, 2 * group_bytes, progress)
        except ValueError as err:  # tensorstore reports I/O failures as ValueError
            raise _write_error(out, err) from None
        files = {}
        for side in ckpt.side_files:
            copy = tmp / side.name
            shutil.copyfile(side, copy)
            files[side.name] = {"bytes": copy.stat().st_size, "sha256": sha256_file(copy)}
        tensors = {d.name: {"dtype": dtype_name(ckpt.tensors[d.name].dtype), "shape": list(d.shape),
                            "sha256": digests[d.name]} for d in decls}
        write_manifest(tmp, ckpt.spec, ckpt.lineage, files=files, tensors=tensors, extra=extra_manifest)
        ckpt.check_inputs()
        record = check(tmp) if check is not None else None
        if record is not None:
            write_manifest(tmp, ckpt.spec, ckpt.lineage, files=files, tensors=tensors,
                           extra={**(extra_manifest or {}), "verification": record})
    return out


def _groups(decls: list[ParamDecl], tensors: TensorMap, group_bytes: int) -> list[list[ParamDecl]]:
    """Consecutive declarations cut into groups of at most `group_bytes` (a larger tensor stands alone)."""
    return cut_in_order(decls, lambda decl: tensors[decl.name].nbytes, group_bytes)


def _produce(decl: ParamDecl, tensor: LazyTensor) -> np.ndarray:
    """The values of one tensor; stacked experts are filled one expert at a time (no second copy)."""
    if not decl.expert_stacked:
        return tensor.load()
    out = np.empty(tensor.shape, tensor.dtype)
    for e in range(tensor.shape[0]):
        out[e] = tensor.part(e)
    return out


def _nest(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}}."""
    tree: dict[str, Any] = {}
    for name, array in arrays.items():
        *parents, leaf = name.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = array
    return tree


def _context() -> Any:
    """Orbax save options: host numpy leaves saved as they are, uncompressed, chunked for streaming."""
    import jax
    import orbax.checkpoint.experimental.v1 as ocp

    # Orbax's background threads log every failure (a full disk: dozens of tracebacks) before the
    # saving thread re-raises it to us; we report it once, as one line.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    quiet_failed_writes()
    storage = ocp.options.ArrayOptions.Saving.StorageOptions

    def per_leaf(keypath: Any, value: Any) -> Any:
        expert = "['experts']" in jax.tree_util.keystr(keypath)  # routed experts: moe.experts.*
        return storage(shard_axes=(0,)) if expert and np.ndim(value) > 1 else None

    ctx = ocp.Context()
    ctx.array.saving.use_compression = False  # random-like weights barely compress; zstd costs the CPU
    ctx.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES
    ctx.array.saving.scoped_storage_options_creator = per_leaf
    ctx.memory.deepcopy_host_arrays = False  # the arrays are ours and never mutated: no second copy
    return ctx


def _save_params(path: Path, tensors: TensorMap, groups: list[list[ParamDecl]], budget: int,
                 progress: bool) -> dict[str, str]:
    """Save every group with `partial.save_async`; return the sha256 of each tensor's bytes.

    Group k+1 is read while group k is written and hashed (on a worker thread, from memory), but two
    groups are in memory together only when they fit in `budget` bytes; otherwise the next group is read
    after the previous one is done. On an error, no save is left running and nothing is
    still writing under `path` when this raises.
    """
    import orbax.checkpoint.experimental.v1 as ocp

    sizes = [sum(tensors[d.name].nbytes for d in g) for g in groups]
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="writing", disable=not progress or None)
    digests: dict[str, str] = {}
    pending: tuple[Any, Future[dict[str, str]]] | None = None
    pending_bytes = 0
    written = DropBehind(path)
    try:
        with _context(), bar, ThreadPoolExecutor(max_workers=1) as hasher:
            for group, nbytes in zip(groups, sizes):
                if pending is not None and pending_bytes + nbytes > budget:
                    digests.update(_finish(pending))
                    pending = None
                    written.step()
                arrays = {d.name: _produce(d, tensors[d.name]) for d in group}
                if pending is not None:
                    digests.update(_finish(pending))
                    written.step()
                pending = ocp.partial.save_async(path, _nest(arrays)), hasher.submit(_sha256_arrays, arrays)
                pending_bytes = nbytes
                del arrays
                bar.update(nbytes)
            if pending is not None:
                digests.update(_finish(pending))
                pending = None
            ocp.partial.finalize(path)
    except BaseException:
        if pending is not None:  # an error left a save running: let it stop before the directory goes
            with suppress(Exception):  # the first error is the one reported
                pending[0].result()
        _settle(path)
        raise
    return digests


def _settle(path: Path, quiet: float = 0.5, limit: float = 20.0) -> None:
    """Wait until nothing under `path` has changed for `quiet` seconds (at most `limit`): a failed save's
    result arrives while its other writes may still be running on tensorstore's threads, which create
    files (and their parent directories) afterwards; the staged output is removed only once they stop."""
    def state() -> list[tuple[str, int, int]]:
        out = []
        for p in path.rglob("*") if path.exists() else ():
            with suppress(OSError):
                st = p.stat()
                out.append((str(p), st.st_size, st.st_mtime_ns))
        return sorted(out)

    deadline, last, since = time.monotonic() + limit, state(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.05)
        now = state()
        if now != last:
            last, since = now, time.monotonic()


def _finish(pending: tuple[Any, Future[dict[str, str]]]) -> dict[str, str]:
    """Wait until a group is committed to disk and hashed; its digests."""
    save, digests = pending
    save.result()
    return digests.result()


def _sha256_arrays(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """The sha256 of each array's bytes, in C order: what `LazyTensor.load().tobytes()` would hash."""
    return {name: hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest() for name, a in arrays.items()}


def _write_error(path: Path, err: Exception) -> UpcyclerError:
    """The one-line report of a failed save; the save's other background tasks are silenced first."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # the save's other tasks: the same failure
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "No space left" in str(err):
        return UpcyclerError(f"{path}: disk full while writing; free space or write elsewhere")
    return UpcyclerError(f"{path}: writing the Orbax checkpoint failed ({text}); check the output location")


class _WithoutClosedLoopReports:
    """`sys.stderr`, minus the tracebacks that end in "RuntimeError: Event loop is closed".

    When one write of an Orbax save fails (a full disk), its other writes fail the same way on threads
    whose event loop is already closed, and tensorstore prints a traceback for each, straight to
    `sys.stderr`, whenever that happens (also after the save has returned). The failure itself reaches
    the caller as one error, so these duplicates are dropped; everything else passes through. Lines are
    collected per thread, so the threads' reports never mix with each other or with our own output.
    """

    _HEADER = "Traceback (most recent call last):"

    def __init__(self, stream: Any):
        self._stream = stream
        self._local = threading.local()

    def _state(self) -> Any:
        state = self._local
        if not hasattr(state, "held"):
            state.held, state.line = [], ""
        return state

    def write(self, text: str) -> int:
        state = self._state()
        state.line += text
        while "\n" in state.line:
            line, state.line = state.line.split("\n", 1)
            self._feed(state, line + "\n")
        if not state.held and state.line and not self._HEADER.startswith(state.line):
            self._stream.write(state.line)  # a partial line outside a traceback (a progress bar)
            state.line = ""
        return len(text)

    def _feed(self, state: Any, line: str) -> None:
        if not state.held and not line.startswith(self._HEADER):
            self._stream.write(line)
            return
        state.held.append(line)
        if len(state.held) > 1 and not line.startswith((" ", "\t")):  # the exception line ends it
            if not line.startswith("RuntimeError: Event loop is closed"):
                self._stream.write("".join(state.held))
            state.held = []

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def quiet_failed_writes() -> None:
    """Route `sys.stderr` through `_WithoutClosedLoopReports` (once per process)."""
    if not isinstance(sys.stderr, _WithoutClosedLoopReports):
        sys.stderr = _WithoutClosedLoopReports(sys.stderr)
