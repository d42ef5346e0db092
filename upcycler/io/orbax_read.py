"""Read an Orbax output directory (layout: `upcycler.io.orbax_layout`) lazily into a `Checkpoint`.

Everything is checked before a tensor byte is read: the manifest parses and holds a valid spec, the
params directory holds an Orbax pytree whose leaves are exactly the tensors the spec declares, with the
declared shapes (and the dtypes the manifest records). Each leaf is opened with tensorstore on the
checkpoint's key-value store (OCDBT or plain files; zarr3 or zarr, as `_METADATA` says), which reads only
the array's metadata; `load()` reads the leaf and `part(e)` only the chunks of row `e` (one expert of a
stacked expert tensor). Any Orbax checkpoint of the canonical tree is accepted: the v1 layout
(`params/state/`) or the v0 one (`params/`). Every tensor read is checked against the sha256 the
manifest records for it (`upcycler.io.integrity`), before a writer renames its output into place.
"""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import SIDE_FILES, Checkpoint, require_weight_dtype
from upcycler.io.integrity import DigestWatch, file_watch
from upcycler.io.manifest import MANIFEST, REWRITE, read_manifest, read_step
from upcycler.io.orbax_layout import TREE, WEIGHTS
from upcycler.layout import declare_params
from upcycler.tensors import LazyTensor, TensorMap, dtype_name
from upcycler.untrusted import load_json_object, shown_path


def read_orbax(path: str | Path, weights: str = "params") -> Checkpoint:
    """Read an Orbax output directory lazily: metadata only here, each leaf's bytes when it is loaded.

    `weights="ema"` reads a training step's moving average (`ema/`) instead of its parameters."""
    path = Path(path)
    manifest = read_manifest(path, fix=f"an Orbax output needs the manifest written with it; {REWRITE}")
    spec = manifest.spec()
    if not (path / WEIGHTS[weights]).is_dir() and weights != "params":
        raise UpcyclerError(f"{shown_path(path)}: holds no {weights}/ weights (only training steps of a run with "
                            "optimizer.ema do); drop --weights ema")
    tree_dir = _tree_dir(path / WEIGHTS[weights])
    metadata = _read_json(tree_dir / "_METADATA", f"the Orbax checkpoint is damaged; {REWRITE}")
    stored = _leaf_names(metadata, tree_dir)
    decls = declare_params(spec)
    declared = {d.name for d in decls}
    missing = [d.name for d in decls if d.name not in stored]
    if missing:
        raise UpcyclerError(f"{tree_dir}: tensor {missing[0]!r} is missing from the Orbax tree "
                            f"({len(missing)} missing); the params do not match the spec in {MANIFEST}; "
                            f"{REWRITE}")
    extra = sorted(stored - declared)
    if extra:
        raise UpcyclerError(f"{tree_dir}: tensor {extra[0]!r} is not part of the model {MANIFEST} describes "
                            f"({len(extra)} unexpected); the params do not match the spec; {REWRITE}")
    stores = _open_leaves(tree_dir, metadata, [d.name for d in decls])
    recorded = manifest.tensors
    digests = manifest.tensor_digests()
    watches: list[DigestWatch] = []
    tensors = {}
    for decl in decls:
        store = stores[decl.name]
        if tuple(store.shape) != decl.shape:
            raise UpcyclerError(f"{tree_dir}: tensor {decl.name!r} has shape {list(store.shape)} but the "
                                f"spec in {MANIFEST} implies {list(decl.shape)}; the params do not match; "
                                f"{REWRITE}")
        tensor = _lazy(store, decl.name, tree_dir)
        require_weight_dtype(shown_path(tree_dir), decl.name, tensor.dtype)
        if decl.name in digests:
            tensor, watch = _watched(tensor, store, f"{shown_path(tree_dir)}: tensor {decl.name!r}",
                                     digests[decl.name])
            watches.append(watch)
        record = recorded.get(decl.name)
        if isinstance(record, dict) and record.get("dtype") not in (None, dtype_name(tensor.dtype)):
            raise UpcyclerError(f"{tree_dir}: tensor {decl.name!r} is stored as {dtype_name(tensor.dtype)} "
                                f"but {MANIFEST} records {record['dtype']}; the params do not match; "
                                f"{REWRITE}")
        tensors[decl.name] = tensor
    step = read_step(path, "orbax", **({"weights": weights} if weights != "params" else {}))
    side = tuple(path / n for n in SIDE_FILES if (path / n).is_file())
    for name, (_, sha) in manifest.file_records().items():
        if path / name in side:
            watch = file_watch(path / name, (path / name).stat().st_size, sha)
            watch.touch()  # copied whole by the writer
            watches.append(watch)
    return Checkpoint(spec, TensorMap(tensors), path, (*manifest.lineage, step), side, inputs=(path,),
                      watches=tuple(watches))


def _watched(tensor: LazyTensor, store: Any, label: str, sha: str) -> tuple[LazyTensor, DigestWatch]:
    """`tensor`, telling a new watch over its C-order bytes about everything it reads."""
    row = prod(tensor.shape[1:]) * np.dtype(tensor.dtype).itemsize if tensor.shape else tensor.nbytes

    def read_range(offset: int, length: int) -> bytes:
        if not tensor.shape or row == 0:
            return tensor.load().tobytes()[offset:offset + length]
        first, last = offset // row, -(-(offset + length) // row)
        rows = np.concatenate([tensor.part(i).reshape(-1).view(np.uint8) for i in range(first, last)])
        return rows[offset - first * row: offset - first * row + length].tobytes()

    watch = DigestWatch(label, tensor.nbytes, sha, read_range, chunk=max(row, 1), ahead=False)

    def load() -> np.ndarray:
        array = tensor.load()
        watch.saw(0, array.reshape(-1).view(np.uint8))
        return array

    def part(i: int) -> np.ndarray:
        array = tensor.part(i)
        watch.saw(i * row, array.reshape(-1).view(np.uint8))
        return array

    return LazyTensor(tensor.shape, tensor.dtype, load, part if tensor.shape else None), watch


def _read_json(path: Path, fix: str) -> dict[str, Any]:
    return load_json_object(path, fix=fix)


def _tree_dir(params: Path) -> Path:
    """The directory holding the pytree: `params/state` (v1 layout) or `params` itself (v0 layout)."""
    if not params.is_dir():
        raise UpcyclerError(f"{params}: missing; an Orbax output keeps its weights there; {REWRITE}")
    for candidate in (params / TREE, params):
        if (candidate / "_METADATA").is_file():
            return candidate
    raise UpcyclerError(f"{params}: no Orbax _METADATA (an unfinished or damaged checkpoint); {REWRITE}")


def _leaf_names(metadata: dict[str, Any], tree_dir: Path) -> set[str]:
    """Dotted names of the leaves recorded in `_METADATA`."""
    entries = metadata.get("tree_metadata")
    if not isinstance(entries, dict):
        raise UpcyclerError(f"{tree_dir / '_METADATA'}: no tree_metadata; the checkpoint is damaged; "
                            f"{REWRITE}")
    try:
        return {".".join(str(k["key"]) for k in e["key_metadata"]) for e in entries.values()}
    except (KeyError, TypeError):
        raise UpcyclerError(f"{tree_dir / '_METADATA'}: malformed tree_metadata; the checkpoint is damaged; "
                            f"{REWRITE}") from None


def _open_leaves(tree_dir: Path, metadata: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A tensorstore per leaf, opened concurrently; reads each array's metadata, none of its bytes."""
    import tensorstore as ts

    context = ts.Context()
    driver = "zarr3" if metadata.get("use_zarr3") else "zarr"
    base = tree_dir.resolve()

    def kvstore(name: str) -> dict[str, Any]:
        if metadata.get("use_ocdbt", True):
            return {"driver": "ocdbt", "base": f"file://{base}", "path": f"{name}/"}
        return {"driver": "file", "path": f"{base / name}/"}

    futures = {n: ts.open({"driver": driver, "kvstore": kvstore(n)}, read=True, open=True, context=context)
               for n in names}
    stores = {}
    for name, future in futures.items():
        try:
            stores[name] = future.result()
        except ValueError as err:
            raise UpcyclerError(f"{tree_dir}: cannot open tensor {name!r} ({_first_line(err)}); the "
                                f"checkpoint is damaged; {REWRITE}") from None
    return stores


def _lazy(store: Any, name: str, tree_dir: Path) -> LazyTensor:
    """A LazyTensor over one stored leaf; `part(i)` reads only the chunks of row `i`."""
    dtype = np.dtype(store.dtype.numpy_dtype)

    def read(view: Any) -> np.ndarray:
        try:
            return view.read().result()
        except ValueError as err:
            raise UpcyclerError(f"{tree_dir}: cannot read tensor {name!r} ({_first_line(err)}); the "
                                f"checkpoint is damaged; {REWRITE}") from None

    return LazyTensor(tuple(store.shape), dtype, lambda: read(store),
                      (lambda i: read(store[i])) if store.rank else None)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
