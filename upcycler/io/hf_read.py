"""Read a Hugging Face checkpoint directory (single or sharded safetensors) into a lazy `Checkpoint`.

Everything is validated before a tensor byte is read: the config parses and names a supported family,
the index names only shards inside the directory that exist, every shard header is whole, every
tensor the config implies is present with the right shape, and no unexpected tensor is left over.
Nothing untrusted is unpickled (only safetensors is read).
"""

from __future__ import annotations

import json
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.families import family_for_config
from upcycler.io.checkpoint import MANIFEST, SIDE_FILES, Checkpoint
from upcycler.io.safetensors_file import TensorEntry, lazy_tensor, read_header
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.tensors import LazyTensor, TensorMap, stack

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_json(path: Path, fix: str | None = None) -> dict:
    """The JSON object in `path`, else a one-line error naming the file and ending in `fix` (by default,
    advice for a downloaded Hugging Face checkpoint)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UpcyclerError(f"{path}: missing; {fix or 'a Hugging Face checkpoint needs it'}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UpcyclerError(f"{path}: unreadable JSON ({err}); {fix or 'fix or re-download it'}") from None
    if not isinstance(data, dict):
        raise UpcyclerError(f"{path}: expected a JSON object; {fix or 'fix or re-download it'}")
    return data


def read_spec(path: Path) -> ModelSpec:
    """The ModelSpec of an HF directory from its config.json alone (works on config-only directories)."""
    cfg_path = path / "config.json"
    cfg = read_json(cfg_path)
    family = family_for_config(cfg, str(cfg_path))
    try:
        return family.read_config(cfg)
    except KeyError as err:
        raise UpcyclerError(f"{cfg_path}: field {err.args[0]!r} is missing; fix the config") from None
    except ValueError as err:
        raise UpcyclerError(f"{cfg_path}: {err}") from None


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
        for name in dict.fromkeys(weight_map.values()):
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


def read_hf(path: Path) -> Checkpoint:
    spec = read_spec(path)
    from upcycler.families import FAMILIES

    family = FAMILIES[spec.family]
    entries: dict[str, TensorEntry] = {}
    for shard in shard_files(path):
        header, _ = read_header(shard)
        for name, entry in header.items():
            if name in entries:
                raise UpcyclerError(f"{shard}: tensor {name!r} also stored in {entries[name].path.name}")
            entries[name] = entry
    tensors: dict[str, LazyTensor] = {}
    used = set()
    for decl in declare_params(spec):
        names = family.hf_names(decl)
        for name in names:
            _check_entry(path, entries, name, decl.shape[1:] if decl.expert_stacked else decl.shape)
        used.update(names)
        if decl.expert_stacked:
            parts = [lambda e=entries[n]: lazy_tensor(e).load() for n in names]
            tensors[decl.name] = stack(parts, decl.shape, entries[names[0]].dtype)
        else:
            tensors[decl.name] = lazy_tensor(entries[names[0]])
    if spec.tie_embeddings:
        used.add("lm_head.weight")  # some writers store the tied head anyway
    extra = [n for n in entries if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise UpcyclerError(
            f"{entries[extra[0]].path}: tensor {extra[0]!r} is not part of the model config.json describes "
            f"({len(extra)} unexpected); check that config.json belongs to these weights"
        )
    lineage = _previous_lineage(path)
    step = {"step": "read", "source": str(path), "format": "hf", "revision": _hub_revision(path),
            "files": {f.name: f.stat().st_size for f in shard_files(path)}}
    side = tuple(path / n for n in SIDE_FILES if (path / n).is_file())
    return Checkpoint(spec, TensorMap(tensors), path, (*lineage, step), side)


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
    manifest = path / MANIFEST
    if manifest.is_file():
        return tuple(read_json(manifest).get("lineage", ()))
    return ()


def _hub_revision(path: Path) -> str | None:
    """The commit of a Hub cache snapshot (`…/snapshots/<commit>/`), if the directory is one."""
    resolved = path.resolve()
    return resolved.name if resolved.parent.name == "snapshots" else None
