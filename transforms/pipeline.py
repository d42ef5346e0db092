"""Plan and run a recipe in one streaming pass: read lazily, transform, cast, fit the family, write.

`plan` does everything but write: it reads only the source's config and safetensors headers (or, for a
config-only directory, nothing but config.json: every tensor is then a placeholder that refuses to be
read), applies the transforms to the spec and the lazy tensors, and computes the resulting config,
the exact parameter counts and the exact output bytes. `--dry-run` prints that plan; `execute` hands
the planned checkpoint to the writer, which pulls each output tensor (one expert at a time) through the
chain of lazy transforms from the source bytes. No intermediate checkpoint is ever written.

A plan whose every step preserves the function is checked before the rename: the command hands `execute`
a `check` (the one a step's transform declares, `registry.TransformHooks.write_check`: for one
`dense-to-moe` step, the in-stream check of `transforms.moe_write_check`, which works beside the write;
else the staged output against the source on a probe, `upcycler.verify.check_written`)
unless the user opts out or `unchecked_reason` says the output cannot be bit-faithful: a step that
changes the function, a `--dtype` narrower than the source's, or a scale that rounds in a 16-bit dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.families import conform, family_named
from upcycler.io import SIDE_FILES, detect_format, read_checkpoint, write_checkpoint
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.hf_read import read_json, read_spec, weight_files_present
from upcycler.io.hf_write import plan_items, split_shards
from upcycler.io.manifest import read_step, recipe_step, transform_step
from upcycler.io.safetensors_file import encode_header
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.summary import format_summary, spec_summary
from upcycler.tensors import LazyTensor, TensorMap, dtype_name, parse_dtype
from upcycler.transforms.recipe import Recipe
from upcycler.transforms.registry import (
    AttentionFitService,
    Note,
    RouterInputsService,
    TransformContext,
    config_dict,
)
from upcycler.units import human_bytes
from upcycler.untrusted import shown_path


@dataclass(frozen=True)
class StepResult:
    """One applied transform: its name, config and what it reported."""

    name: str
    config: dict[str, Any]
    notes: tuple[Note, ...]

    @property
    def exact(self) -> bool:
        return all(n.exact for n in self.notes)


@dataclass(frozen=True)
class Plan:
    """Everything a run will do and produce, known before a tensor byte is read."""

    recipe: Recipe
    ckpt: Checkpoint  # transformed, cast and fitted to the output family, with its lineage
    steps: tuple[StepResult, ...]
    config_only: bool
    config: dict[str, Any] | None  # the config.json an HF output gets
    output_bytes: int
    shards: int
    source_dtype: np.dtype | None = None  # the dtype of the source's weights

    @property
    def exact(self) -> bool:
        return all(s.exact for s in self.steps)

    def to_json(self) -> dict[str, Any]:
        spec = self.ckpt.spec
        return {
            "recipe": self.recipe.to_dict(),
            "config_only_source": self.config_only,
            "steps": [{"transform": s.name, "config": s.config, "function_preserving": s.exact,
                       "notes": [n.text for n in s.notes]} for s in self.steps],
            "function_preserving": self.exact,
            "architecture": spec_summary(spec),
            "total_params": spec.total_params(),
            "active_params": spec.active_params(),
            "output_bytes": self.output_bytes,
            "shards": self.shards,
            "dtype": dtype_name(self.ckpt.tensors["embed"].dtype),
            "config": self.config,
        }

    def describe(self) -> str:
        """The plan for people: steps with their notes, the resulting architecture, counts and bytes."""
        r = self.recipe
        src = f"read    {r.source}" + ("  (config.json only: planned without weights)" if self.config_only else "")
        lines = ["plan", "  " + src]
        for s in self.steps:
            options = ", ".join(f"{k}={v}" for k, v in s.config.items() if v is not None)
            lines.append(f"  {s.name:<7} {options}")
            lines += [f"          {'' if n.exact else '! '}{n.text}" for n in s.notes]
        out = r.output
        dtype = dtype_name(self.ckpt.tensors["embed"].dtype)
        lines.append(f"  write   {out.path if out.path else '(no output path)'} as {out.format}"
                     f"{' ' + self.ckpt.spec.family if out.format == 'hf' else ''}, {dtype}, "
                     f"{self.shards} file(s)")
        lines += ["result", *("  " + line for line in format_summary(spec_summary(self.ckpt.spec)).splitlines())]
        lines.append(f"  output bytes    {self.output_bytes:,} ({human_bytes(self.output_bytes)})")
        lines.append(f"  function        {'preserved' if self.exact else 'NOT preserved (see ! above)'}")
        return "\n".join(lines)


def plan(recipe: Recipe, *, allow_config_only: bool = False,
         router_inputs: Callable[[], RouterInputsService] | None = None,
         attention_fit: Callable[[], AttentionFitService] | None = None) -> Plan:
    """Apply the recipe to the spec and the lazy tensors of its source; nothing is read but headers.

    Each step gets a `TransformContext` with the source, the output dtype and the services the caller lends
    (`router_inputs`, `attention_fit`: the JAX model's, made on first use; None where the caller has none).
    """
    ckpt, config_only = read_source(recipe.source, allow_config_only=allow_config_only)
    source_dtype = ckpt.tensors["embed"].dtype
    output_dtype = parse_dtype(recipe.output.dtype) if recipe.output.dtype else None
    results = []
    for k, step in enumerate(recipe.steps):
        # the first step sees the source as read: a transform may compare other checkpoints with it
        context = TransformContext(checkpoint=ckpt if k == 0 else None, side_files=ckpt.side_files,
                                   output_dtype=output_dtype, router_inputs=router_inputs,
                                   attention_fit=attention_fit)
        try:
            applied = step.transform.apply(step.config, ckpt.spec, ckpt.tensors, context)
        except UpcyclerError as err:  # transforms know the model, not where it came from
            raise UpcyclerError(f"{shown_path(recipe.source)}: {err}") from None
        result = StepResult(step.transform.name, config_dict(step.config), applied.notes)
        results.append(result)
        record = transform_step(result.name, result.config, result.exact, [n.text for n in result.notes],
                                applied.recorded)
        ckpt = ckpt.with_step(record, applied.spec, applied.tensors)
        for other in applied.inputs:  # checkpoints the step read besides its source (--experts-from)
            ckpt = ckpt.replace(inputs=tuple(dict.fromkeys((*ckpt.inputs, *other.inputs))),
                                watches=(*ckpt.watches, *other.watches))
    out = recipe.output
    if out.dtype:
        ckpt = ckpt.cast(parse_dtype(out.dtype))
    exact = all(r.exact for r in results)
    recorded = recipe.to_dict()
    recorded["output"].pop("path")  # the output is the directory the record lives in
    ckpt = ckpt.replace(lineage=(*ckpt.lineage, recipe_step(recorded, exact)))
    if out.format != "hf":
        return Plan(recipe, ckpt, tuple(results), config_only, None, ckpt.tensors.nbytes, 1, source_dtype)
    family = family_named(out.family or ckpt.spec.family)
    spec, tensors = conform(ckpt.spec, ckpt.tensors, family)
    ckpt = ckpt.replace(spec=spec, tensors=tensors)
    shards = split_shards(plan_items(ckpt, family), out.shard_size)
    nbytes = sum(len(encode_header([(i.name, i.shape, i.dtype) for i in shard], {"format": "pt"}))
                 + sum(i.nbytes for i in shard) for shard in shards)
    config = {**family.write_config(spec), "torch_dtype": dtype_name(tensors["embed"].dtype)}
    return Plan(recipe, ckpt, tuple(results), config_only, config, nbytes, len(shards), source_dtype)


def unchecked_reason(p: Plan) -> str:
    """Why the output of `p` cannot be checked against its source bit for bit ("" when it can)."""
    if not p.exact:
        return "the recipe does not preserve the function"
    out_dtype = p.ckpt.tensors["embed"].dtype
    if p.source_dtype is not None and narrower(out_dtype, p.source_dtype):
        return f"--dtype {dtype_name(out_dtype)} rounds the {dtype_name(p.source_dtype)} weights"
    if out_dtype.itemsize < 4 and any(n.rounds for s in p.steps for n in s.notes):
        return f"a scale that is not a power of two rounds weights in {dtype_name(out_dtype)}"
    return ""


def narrower(dtype: np.dtype, than: np.dtype) -> bool:
    """True when casting `than` to `dtype` can round (fewer bytes, or the other 16-bit format)."""
    return dtype.itemsize < than.itemsize or (dtype.itemsize == than.itemsize and dtype != than)


def execute(p: Plan, *, overwrite: bool = False, progress: bool = True,
            check: Callable[[Path], dict] | None = None) -> Path:
    """Write the planned checkpoint (the single pass over the source bytes) and return the output path.

    `check` runs on the staged output before it is renamed into place (see the module docstring).
    """
    out = p.recipe.output
    if p.config_only:
        raise UpcyclerError(f"{p.recipe.source}: has config.json but no weights; only --dry-run can plan from it")
    if out.path is None:
        raise UpcyclerError("no output path given; pass OUT (or use --dry-run)")
    if out.format == "hf":
        return write_checkpoint(p.ckpt, out.path, to="hf", family=p.ckpt.spec.family,
                                shard_size=out.shard_size, overwrite=overwrite, progress=progress, check=check)
    return write_checkpoint(p.ckpt, out.path, to=out.format, overwrite=overwrite, check=check)


def read_source(path: Path, *, allow_config_only: bool) -> tuple[Checkpoint, bool]:
    """The source checkpoint, lazily; a config-only HF directory gives placeholders when allowed."""
    if detect_format(path) == "hf" and not weight_files_present(path):
        if not allow_config_only:
            raise UpcyclerError(f"{path}: has config.json but no weights; only --dry-run can plan from it")
        spec = read_spec(path)
        step = read_step(path, "hf", config_only=True)
        side = tuple(path / n for n in SIDE_FILES if (path / n).is_file())  # its tokenizer, as a full read has
        return Checkpoint(spec, placeholders(spec, _config_dtype(path)), path, (step,), side_files=side), True
    return read_checkpoint(path), False


def placeholders(spec: ModelSpec, dtype: np.dtype) -> TensorMap:
    """A TensorMap with every declared tensor's shape and dtype and no bytes (for planning)."""

    def refuse(*_: Any) -> np.ndarray:
        raise UpcyclerError("this model was planned from config.json alone; it has no tensor bytes to write")

    return TensorMap({d.name: LazyTensor(d.shape, np.float32 if d.is_buffer else dtype, refuse, refuse)
                      for d in declare_params(spec)})


def _config_dtype(path: Path) -> np.dtype:
    cfg = read_json(path / "config.json")
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    try:
        return parse_dtype(str(name))
    except ValueError:
        where = path / "config.json"
        raise UpcyclerError(f"{where}: dtype {name!r} is not supported; use bf16, fp16 or fp32") from None
