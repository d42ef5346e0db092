"""Recipes: a source, a chain of transforms and one output, as a YAML file or built by a command.

    source: ./llama-3-8b              # HF or Orbax directory (relative paths: from the recipe's directory)
    transforms:                       # applied in order, each `name: {options}` (options as on the CLI)
      - depth: {layers: 48, method: identity}
      - dense-to-moe: {experts: 64, topk: 8, granularity: 8}
    output:
      path: ./llama-moe
      format: hf                      # hf | orbax
      family: null                    # HF family to write (default: what the last transform produced)
      dtype: bf16                     # bf16 | fp16 | fp32 (default: keep)
      shard_size: 5GB

`upcycle run recipe.yaml` and every single-transform command (`upcycle depth SRC OUT …`) build a
`Recipe`; `transforms.pipeline` plans and runs it. The recipe is recorded in the output's lineage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io.hf_write import DEFAULT_SHARD_SIZE
from upcycler.locations import bucket_and_key, local_path, recorded_location, url_scheme
from upcycler.schema import options
from upcycler.transforms.registry import Transform, config_dict, transform_named
from upcycler.units import parse_size
from upcycler.untrusted import MAX_YAML_BYTES, describe, duplicate_key, parse_yaml, read_text, shown_path

FORMATS = ("hf", "orbax")
DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Step:
    """One transform of a recipe with its config."""

    transform: Transform
    config: Any

    def to_dict(self) -> dict[str, Any]:
        return {self.transform.name: config_dict(self.config)}


@dataclass(frozen=True)
class Output:
    """Where and how the result is written."""

    path: Path | None  # None: plan only
    format: str = "hf"
    family: str | None = None
    dtype: str | None = None
    shard_size: int = DEFAULT_SHARD_SIZE  # bytes

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise UpcyclerError(f"output format {self.format!r} is unknown; use {' or '.join(FORMATS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UpcyclerError(f"output dtype {self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
        if self.family is not None and self.format != "hf":
            raise UpcyclerError("an output family applies to format hf only; drop it for orbax")

    def to_dict(self) -> dict[str, Any]:
        return {"path": None if self.path is None else str(self.path), "format": self.format,
                "family": self.family, "dtype": self.dtype, "shard_size": self.shard_size}


@dataclass(frozen=True)
class Recipe:
    """A source directory, the transforms to apply in order, and the output."""

    source: Path
    steps: tuple[Step, ...]
    output: Output

    def to_dict(self) -> dict[str, Any]:
        return {"source": recorded_location(self.source), "transforms": [s.to_dict() for s in self.steps],
                "output": self.output.to_dict()}


def single(transform: str, values: dict[str, Any], source: Path, output: Output) -> Recipe:
    """The recipe of one command: `source`, one transform with `values`, `output`."""
    t = transform_named(transform)
    return Recipe(source, (Step(t, t.make_config(values, f"upcycle {t.name}")),), output)


def load_recipe(path: str | Path) -> Recipe:
    """Parse and check a recipe file (no model is read)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise UpcyclerError(f"{shown_path(path)}: no such recipe file; check the path")
    text = read_text(path, max_bytes=MAX_YAML_BYTES, what="recipe (YAML)")
    data = parse_yaml(text, shown_path(path), "fix the recipe")
    twice = duplicate_key(text)
    if twice is not None:
        raise UpcyclerError(f"{shown_path(path)}: line {twice[1]}: key {describe(twice[0])} is given twice in one "
                            "mapping (YAML would keep only the last); remove or rename one")
    return recipe_from_dict(data, path.parent, shown_path(path))


def recipe_from_dict(data: Any, base: Path, where: str) -> Recipe:
    """A recipe from its parsed YAML; relative paths are taken from `base`."""
    if not isinstance(data, dict):
        raise UpcyclerError(f"{where}: a recipe is a mapping with source, transforms and output")
    unknown = [k for k in data if k not in ("source", "transforms", "output")]
    if unknown:
        raise UpcyclerError(f"{where}: unknown key {describe(unknown[0])}; a recipe has source, transforms, output")
    if not isinstance(data.get("source"), str) or not data["source"]:
        raise UpcyclerError(f"{where}: source must be the path of a checkpoint directory")
    items = data.get("transforms") or []
    if not isinstance(items, list) or not items:
        raise UpcyclerError(f"{where}: transforms must be a non-empty list of `name: {{options}}` entries")
    steps = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or len(item) != 1:
            raise UpcyclerError(f"{where}: transforms[{k}] must be one `name: {{options}}` mapping")
        (name, values), = item.items()
        if not isinstance(name, str):
            raise UpcyclerError(f"{where}: transforms[{k}] must be named by a string, not {describe(name)}")
        t = transform_named(name)
        if values is not None and not isinstance(values, dict):
            raise UpcyclerError(f"{where}: the options of {name} must be a mapping, not {describe(values)}")
        steps.append(Step(t, _rebased(t.make_config(values or {}, f"{where}: transforms[{k}] {name}"), base)))
    source = _path(base, data["source"], f"{where}: source", urls=("gs", "hf"))
    return Recipe(source, tuple(steps), _output(data.get("output"), base, where))


def _output(data: Any, base: Path, where: str) -> Output:
    if not isinstance(data, dict):
        raise UpcyclerError(f"{where}: output must be a mapping with at least a path")
    unknown = [k for k in data if k not in ("path", "format", "family", "dtype", "shard_size")]
    if unknown:
        raise UpcyclerError(f"{where}: unknown output key {describe(unknown[0])}; "
                            "use path, format, family, dtype, shard_size")
    if not isinstance(data.get("path"), str) or not data["path"]:
        raise UpcyclerError(f"{where}: output.path must be the directory to write")
    for key in ("format", "family", "dtype"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise UpcyclerError(f"{where}: output.{key} must be a string, not {describe(data[key])}")
    shard_size = parse_size(data.get("shard_size", DEFAULT_SHARD_SIZE), f"{where}: output.shard_size")
    return Output(_path(base, data["path"], f"{where}: output.path", urls=("gs",)), data.get("format") or "hf",
                  data.get("family"),
                  data.get("dtype"), shard_size)


def _rebased(config: Any, base: Path) -> Any:
    """`config` with its relative path options (a path, or a mapping of paths) taken from `base`."""
    changes: dict[str, Any] = {}
    for opt in options(type(config)):
        value = getattr(config, opt.name)
        if isinstance(value, Path):
            changes[opt.name] = _path(base, str(value), opt.name)
        elif isinstance(value, Mapping) and value and all(isinstance(v, Path) for v in value.values()):
            changes[opt.name] = {k: _path(base, str(v), opt.name) for k, v in value.items()}
    return dataclasses.replace(config, **changes) if changes else config


def _path(base: Path, text: str, what: str, urls: tuple[str, ...] = ()) -> Path | str:
    """A recipe's path, relative to the recipe's directory; a URL of a scheme in `urls` stays a URL (`upcycle
    run` fetches or publishes it), any other URL is refused naming `what`."""
    if "\0" in text:
        raise UpcyclerError(f"path {describe(text)} contains a NUL byte; fix the recipe")
    if url_scheme(text) in urls:
        if url_scheme(text) == "gs":
            bucket_and_key(text, what)  # a bucket named, and a key that stays in it
        return text
    path = local_path(text, what).expanduser()
    return path if path.is_absolute() else base / path
