"""Read a Hugging Face checkpoint directory (single or sharded safetensors) into a lazy `Checkpoint`.

Everything is validated before a tensor byte is read: the config parses and names a supported family,
the index names only shards inside the directory that exist, every shard header is whole, every
tensor the config implies is present with the right shape, and no unexpected tensor is left over.
Nothing untrusted is unpickled (only safetensors is read); JSON is read through `upcycler.untrusted`.
When the directory is an upcycler output, every byte read is checked against the sha256 its manifest
records (`upcycler.io.integrity`), before a writer renames its output into place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.families import family_for_config
from upcycler.io.checkpoint import SIDE_FILES, Checkpoint, require_weight_dtype
from upcycler.io.integrity import DigestWatch, file_watch, tensor_watch
from upcycler.io.manifest import MANIFEST, read_manifest, read_step
from upcycler.io.safetensors_file import TensorEntry, lazy_tensor, read_header, stored_bytes
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.tensors import LazyTensor, TensorMap, stack
from upcycler.untrusted import describe, load_json_object, shown_path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_json(path: Path, fix: str | None = None) -> dict:
    """The JSON object in the regular file `path`, else a one-line error naming the file and ending in
    `fix` (by default, advice for a downloaded Hugging Face checkpoint)."""
    return load_json_object(path, fix=fix or "fix or re-download it")


def read_spec(path: Path) -> ModelSpec:
    """The ModelSpec of an HF directory from its config.json alone (works on config-only directories)."""
    cfg_path = path / "config.json"
    cfg = read_json(cfg_path)
    family = family_for_config(cfg, str(cfg_path))
    try:
        return family.read_config(cfg)
    except ValueError as err:  # SpecError: says what is wrong, not where
        raise UpcyclerError(f"{shown_path(cfg_path)}: {err}") from None


def weight_files_present(path: Path) -> bool:
    """Whether an HF directory has any weights at all (a config-only directory can still be planned)."""
    return (path / INDEX).exists() or any(path.glob("*.safetensors"))


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index or the single-file name."""
    index = path / INDEX
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UpcyclerError(f"{index}: no weight_map; fix or re-download the index")
        files = []
        for name in dict.fromkeys(v if isinstance(v, str) else describe(v) for v in weight_map.values()):
            shard = plain_member(path, name, index)
            if not shard.is_file():
                raise UpcyclerError(f"{index}: names shard {name!r}, which is missing; download every shard")
            files.append(shard)
        return files
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise UpcyclerError(
        f"{path}: no {SINGLE} or {INDEX}; only safetensors checkpoints are read "
        "(convert .bin files with transformers' save_pretrained first)"
    )


def plain_member(root: Path, name: object, named_by: Path, fix: str | None = None) -> Path:
    """`root / name` for a plain file name; anything with a path separator or `..` escapes and is refused.

    Only the name is checked, not where it resolves, so Hub cache snapshots (symlinks to blobs) still read.
    `named_by` is the file that names it; `fix`, when given, ends the error.
    """
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or name.startswith("~") or "\0" in name:
        raise UpcyclerError(
            f"{named_by}: names {name!r}, which escapes the directory; only plain file names next to it "
            "are allowed" + (f"; {fix}" if fix else "")
        )
    return root / name


def read_hf(path: Path, *, watched: bool = True) -> Checkpoint:
    """An HF directory, lazily. With `watched` (the default), every byte read from a file an upcycler
    manifest records is hashed against it (`Checkpoint.check_inputs`); `watched=False` skips that, for a
    reader whose bytes a watched read of the same files already checks (a write's own check)."""
    spec = read_spec(path)
    from upcycler.families import FAMILIES

    family = FAMILIES[spec.family]
    shards = shard_files(path)
    entries: dict[str, TensorEntry] = {}
    for shard in shards:
        header, _ = read_header(shard)
        for name, entry in header.items():
            if name in entries:
                raise UpcyclerError(f"{shard}: tensor {name!r} also stored in {entries[name].path.name}")
            entries[name] = entry
    watches = _manifest_watches(path, shards, entries) if watched else {}
    tensors: dict[str, LazyTensor] = {}
    used = set()
    for decl in declare_params(spec):
        names = family.hf_names(decl)
        for name in names:
            _check_entry(path, entries, name, decl.shape[1:] if decl.expert_stacked else decl.shape)
            first = entries[names[0]]
            require_weight_dtype(shown_path(entries[name].path), name, entries[name].dtype,
                                 like=(names[0], first.dtype) if name != names[0] else None)
        used.update(names)
        if decl.expert_stacked:
            experts = [_watched(entries[n], watches) for n in names]
            tensors[decl.name] = stack([e.load for e in experts], decl.shape, entries[names[0]].dtype,
                                       stored=[e.stored for e in experts])
        else:
            tensors[decl.name] = _watched(entries[names[0]], watches)
    if spec.tie_embeddings:
        used.add("lm_head.weight")  # some writers store the tied head anyway
    extra = [n for n in entries if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise UpcyclerError(
            f"{entries[extra[0]].path}: tensor {extra[0]!r} is not part of the model config.json describes "
            f"({len(extra)} unexpected); check that config.json belongs to these weights"
        )
    lineage = _previous_lineage(path)
    step = read_step(path, "hf", revision=_hub_revision(path), files={f.name: f.stat().st_size for f in shards})
    side = tuple(path / n for n in SIDE_FILES if (path / n).is_file())
    for name in ("config.json", INDEX, *(f.name for f in side)):
        if name in watches:
            watches[name].touch()  # read or copied whole
    return Checkpoint(spec, TensorMap(tensors), path, (*lineage, step), side, inputs=(path,),
                      watches=tuple(watches.values()))


def _manifest_watches(path: Path, shards: list[Path], entries: dict[str, TensorEntry]) -> dict[str, DigestWatch]:
    """A digest watch per file the manifest records (none when the directory has no manifest), keyed by
    file name; a shard whose every tensor has a recorded xxh3-128 gets one watch per tensor instead, keyed
    by tensor name, so what is checked is what is read."""
    if not (path / MANIFEST).is_file():
        return {}
    manifest = read_manifest(path)
    records = manifest.file_records()
    digests = manifest.tensor_xxh3()
    by_shard: dict[str, list[TensorEntry]] = {}
    for entry in entries.values():
        by_shard.setdefault(entry.path.name, []).append(entry)
    watches = {}
    for name, (size, sha) in records.items():
        file = path / name
        if "/" in name or not file.is_file():
            continue  # a file the manifest lists but the directory no longer has is never read
        actual = file.stat().st_size
        if size is not None and actual != size:
            raise UpcyclerError(f"{shown_path(file)}: {actual:,} bytes but {MANIFEST} records {size:,} "
                                "(truncated, or modified after it was written); re-copy or re-download it")
        tensors = by_shard.get(name, [])
        if tensors and all(t.name in digests for t in tensors):
            for t in tensors:
                watches[t.name] = tensor_watch(file, t.name, t.start, t.nbytes, digests[t.name])
        else:
            watches[name] = file_watch(file, actual, sha)
    return watches


def _watched(entry: TensorEntry, watches: dict[str, DigestWatch]) -> LazyTensor:
    """`lazy_tensor(entry)`, telling the watch of its file (if any) about every byte range it reads."""
    tensor = lazy_tensor(entry)
    own = watches.get(entry.name)  # this tensor's digest, or its file's
    watch = own or watches.get(entry.path.name)
    if watch is None:
        return tensor
    row = int(np.prod(entry.shape[1:], dtype=np.int64)) * entry.dtype.itemsize
    base = entry.start if own is not None else 0  # a tensor's watch takes offsets into the tensor

    def seen(offset: int, data) -> None:
        watch.saw(offset - base, data)

    def load() -> np.ndarray:
        array = tensor.load()
        seen(entry.start, array.reshape(-1).view(np.uint8))
        return array

    def part(i: int) -> np.ndarray:
        array = tensor.part(i)
        seen(entry.start + i * row, array.reshape(-1).view(np.uint8))
        return array

    return LazyTensor(tensor.shape, tensor.dtype, load, part if entry.shape else None,
                      stored=stored_bytes(entry, seen))


def _check_entry(root: Path, entries: dict[str, TensorEntry], name: str, shape: tuple[int, ...]) -> None:
    entry = entries.get(name)
    if entry is None:
        raise UpcyclerError(
            f"{root}: tensor {name!r} is missing from the safetensors files; the checkpoint is incomplete "
            "or config.json does not match the weights"
        )
    if entry.shape != tuple(shape):
        raise UpcyclerError(
            f"{entry.path}: tensor {name!r} has shape {list(entry.shape)} but config.json implies {list(shape)}; "
            "the config does not match the weights"
        )


def _previous_lineage(path: Path) -> tuple[dict, ...]:
    if not (path / MANIFEST).is_file():
        return ()
    return read_manifest(path).lineage


def _hub_revision(path: Path) -> str | None:
    """The commit of a Hub cache snapshot (`…/snapshots/<commit>/`), if the directory is one."""
    resolved = path.resolve()
    return resolved.name if resolved.parent.name == "snapshots" else None
