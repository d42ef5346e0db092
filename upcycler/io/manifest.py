"""The manifest `upcycler.json`: the one owner of its format, and of the lineage steps it records.

Every directory upcycler writes (HF, Orbax, a training step) holds one:

    {"format": 1,
     "spec":    ModelSpec as JSON,
     "lineage": [step, …],                         # what was read and done, oldest first
     "files":   {name: {"bytes": n, "sha256": h}}, # every file written beside it (HF: all; Orbax: side files)
     "tensors": {name: {"dtype", "shape", "sha256"}},   # Orbax: digest of each tensor's C-order bytes
     "tensors": {name: {"xxh3_128": h}},                # HF: each stored tensor's bytes, as written
     …}                                             # extra keys a writer adds (e.g. "verification")

`read_manifest` is the only parser (bounded, validated, one-line errors naming the file); `write_manifest`
the only writer. A lineage step is a JSON object whose "step" names its kind; the `*_step` functions below
build each kind, so its fields are declared once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from upcycler.errors import UpcyclerError
from upcycler.families import family_named
from upcycler.locations import is_remote, recorded_location
from upcycler.spec import ModelSpec
from upcycler.untrusted import describe, load_json_object, shown_path

_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_XXH3 = re.compile(r"[0-9a-fA-F]{32}")

MANIFEST = "upcycler.json"
FORMAT = 1
XXH3 = "xxh3_128"  # the key of an HF tensor's digest in the "tensors" table
REWRITE = "re-write the directory with upcycler"


# --- lineage steps -----------------------------------------------------------------------------------

class ReadStep(TypedDict):
    step: str  # "read"
    source: str
    format: str  # "hf" | "orbax"
    revision: NotRequired[str | None]  # the commit of a Hub cache snapshot
    files: NotRequired[dict[str, int]]  # weight file sizes
    config_only: NotRequired[bool]
    weights: NotRequired[str]  # "ema": a training step's moving average rather than its parameters


class ConvertStep(TypedDict):
    step: str  # "convert"
    to: str
    family: str
    dtype: str | None


class TransformStep(TypedDict):
    step: str  # the transform's name, e.g. "depth"
    config: dict[str, Any]
    function_preserving: bool
    notes: list[str]
    # what the transform recorded of its result (`upcycler.transforms.registry.record`); depth:
    layer_map: NotRequired[list[int]]  # the source layer of every output layer
    new_layers: NotRequired[list[int]]  # the output layers that are copies (not a source layer's first)


class RecipeStep(TypedDict):
    step: str  # "recipe"
    recipe: dict[str, Any]
    function_preserving: bool


class MergeStep(TypedDict):
    step: str  # "merge"
    method: str
    options: dict[str, Any]
    weights: list[float] | None
    inputs: list[dict[str, Any]]  # {source, step, lineage} of each input, oldest first
    base: NotRequired[dict[str, Any]]  # {source, lineage} of the base model (task-vector methods)
    seed: NotRequired[int]
    dtype: NotRequired[str]


class PretrainStep(TypedDict):
    step: str  # "continued-pretrain"
    trained_steps: int
    tokens: int
    data: dict[str, Any]  # {sources, phases}
    optimizer: dict[str, Any]  # {lr, schedule, trainable, ema}
    rewinds: NotRequired[list[dict[str, Any]]]  # loss-spike rewinds so far: {step, averaged}
    init_from_merge: NotRequired[str]  # the checkpoints the run started from, as `model.init_from_merge`


LineageStep = Mapping[str, Any]  # one of the above, or a step written by a newer version


def read_step(source: Path, fmt: str, **details: Any) -> ReadStep:
    """A checkpoint was read from `source` in format `fmt` (details: revision, files, config_only); a local
    copy of a bucket or Hub source is recorded as its origin (`gs://…`, `org/name`)."""
    return ReadStep(step="read", source=recorded_location(source), format=fmt, **details)  # type: ignore[typeddict-item]


def convert_step(to: str, family: str, dtype: str | None) -> ConvertStep:
    """The checkpoint was written in another format, family or dtype."""
    return ConvertStep(step="convert", to=to, family=family, dtype=dtype)


def transform_step(name: str, config: dict[str, Any], exact: bool, notes: Sequence[str],
                   recorded: Mapping[str, Any] | None = None) -> TransformStep:
    """Transform `name` was applied with `config`; `exact` when it preserves the function. `recorded`: the
    fields the transform recorded of its result (e.g. depth's `layer_map` and `new_layers`)."""
    step = TransformStep(step=name, config=config, function_preserving=exact, notes=list(notes))
    clash = set(step).intersection(recorded or {})
    if clash:
        raise ValueError(f"transform {name!r} recorded lineage fields {sorted(clash)} the step already has")
    return TransformStep(**step, **(recorded or {}))  # type: ignore[typeddict-item]


def recipe_step(recipe: dict[str, Any], exact: bool) -> RecipeStep:
    """The transforms above came from this recipe, applied in one pass."""
    return RecipeStep(step="recipe", recipe=recipe, function_preserving=exact)


def merge_step(method: str, options: dict[str, Any], weights: Sequence[float] | None,
               inputs: Sequence[dict[str, Any]], **details: Any) -> MergeStep:
    """Checkpoints were merged with `method` (details: base, seed, dtype)."""
    return MergeStep(step="merge", method=method, options=options,  # type: ignore[typeddict-item]
                     weights=None if weights is None else list(weights), inputs=list(inputs), **details)


def pretrain_step(trained_steps: int, tokens: int, data: dict[str, Any], optimizer: dict[str, Any],
                  **details: Any) -> PretrainStep:
    """The model was trained on for `trained_steps` steps (`tokens` tokens) with this data and optimiser
    (details: rewinds, init_from_merge)."""
    return PretrainStep(step="continued-pretrain", trained_steps=trained_steps, tokens=tokens, data=data,  # type: ignore[typeddict-item]
                        optimizer=optimizer, **details)


# --- reading lineage ---------------------------------------------------------------------------------

def new_layers(lineage: Sequence[LineageStep]) -> tuple[int, ...] | None:
    """The decoder layers that depth growth inserted, composed over every depth step of `lineage`; None
    when there is no depth step, or one that did not record its layer map (written by an older upcycler).

    An output layer of a depth step is new when the step recorded it as new (a copy) or its source layer
    was new before the step. Other steps keep the layer count, so they keep the new layers as they are.
    A malformed record is one `UpcyclerError` line."""
    new: set[int] | None = None
    layers: int | None = None  # the layer count after the last depth step
    for index, step in enumerate(lineage):
        if step.get("step") != "depth":
            continue
        layer_map, added = step.get("layer_map"), step.get("new_layers")
        if layer_map is None or added is None:
            return None
        if not (_layer_list(layer_map, layers) and _layer_list(added, len(layer_map))):
            raise UpcyclerError(f"lineage step {index} (depth) records a malformed layer_map or new_layers "
                                f"({describe(layer_map)}, {describe(added)}); fix the manifest or {REWRITE}")
        before, copies = new or set(), set(added)
        new = {j for j, source in enumerate(layer_map) if j in copies or source in before}
        layers = len(layer_map)
    return None if new is None else tuple(sorted(new))


def expert_sources(lineage: Sequence[LineageStep], experts: int) -> list[str] | None:
    """The source model of each of `experts` routed experts, by name, as the last step that took experts
    from several models (`dense-to-moe --experts-from`) recorded them; None when no step did. Later steps
    keep the experts in place (depth growth copies layers, merges average experts one by one). A malformed
    record is one `UpcyclerError` line."""
    for index, step in enumerate(reversed(lineage)):
        names = step.get("expert_sources")
        if names is None:
            continue
        if not (isinstance(names, list) and len(names) == experts and all(isinstance(n, str) for n in names)):
            raise UpcyclerError(f"lineage step {len(lineage) - 1 - index} records malformed expert_sources "
                                f"({describe(names)}) for {experts} experts; fix the manifest or {REWRITE}")
        return names
    return None


def _layer_list(value: Any, below: int | None) -> bool:
    """A list of layer indices, each below `below` (when known)."""
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i and (below is None or i < below) for i in value
    )


# --- the manifest ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Manifest:
    """A parsed `upcycler.json`; `spec()` validates the model spec only when asked."""

    path: Path
    raw_spec: Any
    lineage: tuple[dict[str, Any], ...]
    files: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)

    def file_records(self, fix: str = REWRITE) -> dict[str, tuple[int, str]]:
        """`files` as {name: (bytes, sha256)}, every record checked (a 64-hex digest, a byte count)."""
        out = {}
        for name, record in self.files.items():
            size, sha = record.get("bytes"), record.get("sha256")
            if not (isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 2**63
                    and isinstance(sha, str) and _SHA256.fullmatch(sha)):
                raise self._malformed("files", name, record, fix)
            out[name] = (size, sha.lower())
        return out

    def tensor_digests(self, fix: str = REWRITE) -> dict[str, str]:
        """`tensors` as {name: sha256} for the records that carry a digest (each checked: 64 hex digits)."""
        out = {}
        for name, record in self.tensors.items():
            if "sha256" not in record:
                continue  # written without digests: nothing to check
            sha = record["sha256"]
            if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
                raise self._malformed("tensors", name, record, fix)
            out[name] = sha.lower()
        return out

    def tensor_xxh3(self, fix: str = REWRITE) -> dict[str, str]:
        """`tensors` as {name: xxh3-128 hex} for the records that carry one (HF writes; each checked)."""
        out = {}
        for name, record in self.tensors.items():
            if XXH3 not in record:
                continue
            digest = record[XXH3]
            if not (isinstance(digest, str) and _XXH3.fullmatch(digest)):
                raise self._malformed("tensors", name, record, fix)
            out[name] = digest.lower()
        return out

    def _malformed(self, table: str, name: object, record: object, fix: str) -> UpcyclerError:
        return UpcyclerError(f"{shown_path(self.path)}: the '{table}' record of {describe(name)} is malformed "
                             f"({describe(record)}); fix the manifest or {fix}")

    def spec(self, fix: str = REWRITE) -> ModelSpec:
        """The recorded ModelSpec, or one line naming the manifest and what is wrong."""
        if not isinstance(self.raw_spec, dict):
            raise UpcyclerError(f"{shown_path(self.path)}: no 'spec' object; fix the manifest or {fix}")
        try:
            spec = ModelSpec.from_json(json.dumps(self.raw_spec))
            family_named(spec.family)
            return spec
        except UpcyclerError as err:  # SpecError: what is wrong and how to fix it, not where
            raise UpcyclerError(f"{shown_path(self.path)}: 'spec' is not a valid model spec: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise UpcyclerError(f"{shown_path(self.path)}: 'spec' is not a valid model spec "
                                f"({describe(str(err), 160)}); fix the manifest or {fix}") from None


def read_manifest(directory: Path, *, fix: str = REWRITE) -> Manifest:
    """The manifest of `directory`, read bounded; format, lineage and record tables checked for shape."""
    path = directory / MANIFEST
    raw = load_json_object(path, fix=fix, what="manifest")
    if raw.get("format") != FORMAT:
        raise UpcyclerError(f"{shown_path(path)}: unknown manifest format {describe(raw.get('format'))}; "
                            "upgrade upcycler")
    lineage = raw.get("lineage", [])
    if not isinstance(lineage, list) or not all(isinstance(step, dict) for step in lineage):
        raise UpcyclerError(f"{shown_path(path)}: 'lineage' must be a list of steps; fix the manifest or {fix}")
    tables = {}
    for key in ("files", "tensors"):
        table = raw.get(key, {})
        if not isinstance(table, dict) or not all(isinstance(r, dict) for r in table.values()):
            raise UpcyclerError(f"{shown_path(path)}: '{key}' must map names to records, not "
                                f"{describe(table)}; fix the manifest or {fix}")
        tables[key] = table
    extra = {k: v for k, v in raw.items() if k not in ("format", "spec", "lineage", "files", "tensors")}
    return Manifest(path, raw.get("spec"), tuple(lineage), tables["files"], tables["tensors"], extra)


def write_manifest(directory: Path, spec: ModelSpec, lineage: Sequence[LineageStep], *,
                   files: Mapping[str, Mapping[str, Any]] | None = None,
                   tensors: Mapping[str, Mapping[str, Any]] | None = None,
                   extra: Mapping[str, Any] | None = None) -> Path:
    """Write `directory/upcycler.json` atomically (a temporary name, then a rename; in a bucket, one object
    write); returns its path."""
    manifest: dict[str, Any] = {"format": FORMAT, "spec": json.loads(spec.to_json()),
                                "lineage": [dict(step) for step in lineage], **(extra or {})}
    if files is not None:
        manifest["files"] = {name: dict(record) for name, record in files.items()}
    if tensors is not None:
        manifest["tensors"] = {name: dict(record) for name, record in tensors.items()}
    path = directory / MANIFEST
    if is_remote(directory):  # an object is written whole or not at all
        path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        return path
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
