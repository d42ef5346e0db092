"""Write a `Checkpoint` as a Hugging Face directory, streaming, and only ever rename a finished one into place.

- Tensors are written in canonical order, one tensor (one expert, for stacked experts) in memory at a
  time; the next one is produced on a worker thread while the current one is written. A tensor that is
  a source file's bytes unchanged (every tensor of a conversion or a depth growth, the attention, norms
  and embeddings of an upcycle) is streamed from that file through one reused 8 MiB buffer instead.
- Shards are cut at `shard_size` bytes (`model-0000K-of-0000N.safetensors` + index with `total_size`),
  or a single `model.safetensors` when everything fits.
- `config.json` is written for the target family; tokenizer and generation files are copied.
- `upcycler.json` records the spec, the lineage, the sha256 of every file written and the xxh3-128 of
  every tensor (hashed from the buffers written, streamed or produced).
- The shards are checked against the declared layout before anything else is written (`check_layout`):
  every declared tensor present once with its shape, dtype and byte count, nothing else; a missing expert
  or shard is an error naming it.
- A `check` (the function check of a function-preserving write) runs on the staged directory once it is
  complete; what it returns is recorded as `verification` in `upcycler.json`, and an error it raises
  discards the output. A check with a `begin()` is told when the write starts, and with a `written(name)`
  of each tensor written, so it can work beside the write.
- Everything goes to a hidden temporary sibling that is renamed to `out` only when complete
  (`upcycler.io.staging`: never over a source, never over a directory upcycler did not write); on any
  error (a full disk, a source that differs from its manifest) it is removed, so no finished-looking
  output is left behind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from math import prod
from pathlib import Path

import numpy as np
from tqdm import tqdm

from upcycler.errors import UpcyclerError
from upcycler.families import Family, conform, family_named
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.hashing import sha256_file
from upcycler.io.hf_read import INDEX, SINGLE
from upcycler.io.manifest import XXH3, write_manifest
from upcycler.io.safetensors_file import ShardWriter, read_header
from upcycler.io.staging import staged_directory
from upcycler.layout import account, declare_params
from upcycler.tensors import StoredBytes, cut_in_order, dtype_name, read_ahead
from upcycler.untrusted import shown_path

DEFAULT_SHARD_SIZE = 5 * 1000**3


@dataclass(frozen=True)
class _Item:
    """One stored tensor: its HF name, shape, dtype and how to produce its bytes (or where they are stored,
    when they are a file's bytes unchanged)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]
    stored: StoredBytes | None = None

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


def plan_items(ckpt: Checkpoint, family: Family) -> list[_Item]:
    """Every tensor to store, in canonical order, with per-expert items for stacked experts."""
    account(ckpt.spec, ckpt.tensors)
    items = []
    for decl in declare_params(ckpt.spec):
        tensor = ckpt.tensors[decl.name]  # every declared tensor is there: `account` checked the map
        names = family.hf_names(decl)
        if decl.expert_stacked:
            for e, name in enumerate(names):
                items.append(_Item(name, decl.shape[1:], tensor.dtype, lambda t=tensor, e=e: t.part(e),
                                   tensor.stored_part(e)))
        else:
            items.append(_Item(names[0], decl.shape, tensor.dtype, tensor.load, tensor.stored))
    return items


def split_shards(items: list[_Item], shard_size: int) -> list[list[_Item]]:
    """Greedy cut into shards of at most `shard_size` bytes (a larger tensor gets a shard of its own)."""
    return cut_in_order(items, lambda item: item.nbytes, shard_size)


def write_hf(
    ckpt: Checkpoint,
    out: Path,
    *,
    family: str | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
    extra_manifest: dict | None = None,
    check: Callable[[Path], dict] | None = None,
) -> Path:
    """Write `ckpt` to `out` in `family` (default: the spec's own) and return `out`.

    Preserves every tensor bit for bit (casts happen before, in the TensorMap); adds only what
    `conform` proves function-neutral (zero biases a family requires).
    """
    target = family_named(family or ckpt.spec.family)
    spec, tensors = conform(ckpt.spec, ckpt.tensors, target)
    ckpt = ckpt.replace(spec=spec, tensors=tensors)
    items = plan_items(ckpt, target)
    shards = split_shards(items, shard_size)
    total = sum(i.nbytes for i in items)
    with staged_directory(out, overwrite=overwrite, sources=ckpt.inputs) as tmp:
        begin = getattr(check, "begin", None)
        if begin is not None:  # a check that works beside the write (dense-to-moe's)
            begin()
        shard_hashes, tensor_digests = _write_shards(tmp, shards, total, progress, getattr(check, "written", None))
        files: dict[str, str | None] = dict(shard_hashes)
        check_layout(tmp, shards, out)
        config = {**target.write_config(spec), "torch_dtype": dtype_name(tensors["embed"].dtype)}
        _write_json(tmp / "config.json", config)
        files["config.json"] = None
        if len(shards) > 1:
            index = {"metadata": {"total_size": total, "total_parameters": spec.total_params()},
                     "weight_map": {i.name: name for name, shard in zip(_shard_names(len(shards)), shards)
                                    for i in shard}}
            _write_json(tmp / INDEX, index)
            files[INDEX] = None
        for side in ckpt.side_files:
            shutil.copyfile(side, tmp / side.name)
            files[side.name] = None
        records = {name: _file_record(tmp / name, sha) for name, sha in files.items()}
        tensors = {name: {XXH3: digest} for name, digest in tensor_digests.items()}
        write_manifest(tmp, spec, ckpt.lineage, extra=extra_manifest, files=records, tensors=tensors)
        ckpt.check_inputs()
        if check is not None:
            write_manifest(tmp, spec, ckpt.lineage, extra={**(extra_manifest or {}), "verification": check(tmp)},
                           files=records, tensors=tensors)
    return out


def check_layout(directory: Path, shards: list[list[_Item]], out: Path) -> None:
    """Refuse a staged output (`directory`, to become `out`) whose shards do not hold exactly the planned
    tensors (name, shape, dtype, bytes), naming the first tensor missing, unexpected or different and its
    shard; reads only the shard headers."""
    found: dict[str, tuple[str, tuple[int, ...], np.dtype, int]] = {}
    for name in _shard_names(len(shards)):
        path = directory / name
        if not path.is_file():
            raise UpcyclerError(f"{shown_path(out / name)}: a planned shard was not written; nothing was written")
        for entry in read_header(path)[0].values():
            found[entry.name] = (name, entry.shape, entry.dtype, entry.nbytes)
    for name, shard in zip(_shard_names(len(shards)), shards):
        for item in shard:
            got = found.pop(item.name, None)
            want = (name, tuple(item.shape), np.dtype(item.dtype), item.nbytes)
            if got is None:
                raise UpcyclerError(f"{shown_path(out / name)}: tensor {item.name} is missing from the "
                                    "written output; nothing was written")
            if (got[0], tuple(got[1]), np.dtype(got[2]), got[3]) != want:
                raise UpcyclerError(f"{shown_path(out / name)}: tensor {item.name} was written as "
                                    f"{got[1]} {got[2]} in {got[0]}, the plan says {want[1]} {want[2]}; "
                                    "nothing was written")
    if found:
        extra = min(found)
        raise UpcyclerError(f"{shown_path(out / found[extra][0])}: holds tensor {extra} that the model "
                            "does not declare; nothing was written")


def _shard_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def _write_shards(tmp: Path, shards: list[list[_Item]], total: int, progress: bool,
                  written: Callable[[str], None] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Write every shard; return the sha256 of each and the xxh3-128 of each tensor, computed while the
    bytes streamed out. A tensor stored unchanged in a source file is streamed from it
    (`ShardWriter.copy`); any other is produced on a worker thread while the one before is written.
    `written(name)`, when given, is told of each tensor once it is written."""
    hashes, digests = {}, {}
    arrays = read_ahead([item.produce if item.stored is None else partial(_stored, item.stored)
                         for shard in shards for item in shard])
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not progress or None) as bar:
        for name, shard in zip(_shard_names(len(shards)), shards):
            writer = ShardWriter(tmp / name, [(i.name, i.shape, i.dtype) for i in shard], {"format": "pt"})
            try:
                for item in shard:
                    payload = next(arrays)
                    if isinstance(payload, StoredBytes):
                        writer.copy(item.name, payload)
                    else:
                        writer.write(item.name, payload)
                    del payload
                    bar.update(item.nbytes)
                    if written is not None:
                        written(item.name)
                hashes[name] = writer.close()
                digests.update(writer.tensor_digests)
            except BaseException:
                writer.abort()
                raise
    return hashes, digests


def _stored(where: StoredBytes) -> StoredBytes:
    return where  # read by the writer itself, in slices


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _file_record(path: Path, sha: str | None) -> dict:
    """Size and sha256 of a written file (hashed now unless it was hashed while streaming)."""
    return {"bytes": path.stat().st_size, "sha256": sha or sha256_file(path)}
