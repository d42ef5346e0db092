"""Check a merge before any tensor is read, and describe it: `plan_merge` → `MergePlan` → `describe_plan`.

Everything the user can get wrong is refused here with one line naming the fix: too few or too many
inputs for the method, a missing or unexpected `--base`, weights that are missing, unexpected, of the
wrong count, or (for `linear`) not summing to 1, options the method does not take or out of range, and
inputs whose architectures differ (naming the first differing `ModelSpec` field). Only checkpoint
headers have been read at this point, so a refused merge costs nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import Checkpoint
from upcycler.layout import declare_params
from upcycler.locations import recorded_location
from upcycler.merge.registry import Method, get_method
from upcycler.spec import ModelSpec
from upcycler.tensors import dtype_name, parse_dtype
from upcycler.units import human_bytes, human_count

WEIGHT_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class MergeInput:
    """One checkpoint to merge and, when it came from a training run directory, its step."""

    checkpoint: Checkpoint
    step: int | None = None

    @property
    def label(self) -> str:
        source = self.checkpoint.source
        return recorded_location(source) if source is not None else "(in memory)"


@dataclass(frozen=True)
class MergePlan:
    """A checked merge: method, inputs in order, base, final weights, bound options, seed, output dtype."""

    method: Method
    inputs: tuple[MergeInput, ...]
    base: Checkpoint | None
    weights: tuple[float, ...] | None  # averaging: the weights applied; task methods: per-input scales
    options: Mapping[str, Any]
    seed: int
    dtype: np.dtype | None  # None: every tensor keeps the first input's dtype


def plan_merge(
    inputs: Sequence[Checkpoint | MergeInput],
    method: str,
    *,
    base: Checkpoint | None = None,
    weights: Sequence[float] | None = None,
    normalize: bool = True,
    seed: int = 0,
    dtype: str | np.dtype | None = None,
    options: Mapping[str, Any] | None = None,
) -> MergePlan:
    """Validate a merge of `inputs` (ordered oldest → newest) with `method` and return its plan.

    `weights` are the per-input weights of `linear` (which must sum to 1 unless `normalize=False`) or
    the per-input scales of the task-vector methods (default 1). `options` are the method's own
    (e.g. `{"alpha": 0.2}` for ema); `seed` drives the random drops of DARE.
    """
    m = get_method(method)
    items = tuple(i if isinstance(i, MergeInput) else MergeInput(i) for i in inputs)
    _check_counts(m, len(items), base)
    _check_specs(items, base)
    bound = m.bind(dict(options or {}))
    if seed < 0:
        raise UpcyclerError(f"--seed {seed} is negative; use a seed >= 0")
    final = _weights(m, len(items), weights, normalize, bound)
    out_dtype = None if dtype is None else (parse_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype))
    return MergePlan(m, items, base, final, bound, seed, out_dtype)


def _check_counts(m: Method, n: int, base: Checkpoint | None) -> None:
    if n < m.min_inputs:
        need = "exactly" if m.max_inputs == m.min_inputs else "at least"
        raise UpcyclerError(f"method {m.name} needs {need} {m.min_inputs} inputs, got {n}; pass more checkpoints")
    if m.max_inputs is not None and n > m.max_inputs:
        raise UpcyclerError(f"method {m.name} merges at most {m.max_inputs} inputs, got {n}; pass fewer")
    if m.needs_base and base is None:
        raise UpcyclerError(f"method {m.name} needs --base (the model the task vectors are taken from)")
    if not m.needs_base and base is not None:
        raise UpcyclerError(f"method {m.name} takes no --base; drop it or use task-arithmetic, ties or dare")


def _weights(m: Method, n: int, given: Sequence[float] | None, normalize: bool,
             options: Mapping[str, Any]) -> tuple[float, ...] | None:
    if given is not None and m.weights == "none":
        raise UpcyclerError(f"method {m.name} computes its own weights; drop --weights or use linear")
    if given is None and m.weights == "required":
        raise UpcyclerError(f"method {m.name} needs --weights, one per input ({n})")
    if given is not None and len(given) != n:
        raise UpcyclerError(f"--weights has {len(given)} values for {n} inputs; give one weight per input")
    if given is not None and not all(math.isfinite(w) for w in given):
        raise UpcyclerError("--weights must be finite numbers")
    if not normalize and not (m.kind == "average" and m.weights == "required"):
        raise UpcyclerError(f"--no-normalize applies to linear only; method {m.name} does not check a weight sum")
    if m.kind == "tensor":
        return None if m.weights == "none" else tuple(float(w) for w in (given or [1.0] * n))
    args = {"weights": np.asarray(given, dtype=np.float64)} if m.weights == "required" else {}
    w = np.asarray(m.fn(n, **args, **options), dtype=np.float64)
    if normalize and abs(math.fsum(w) - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise UpcyclerError(
            f"--weights sum to {math.fsum(w):g}, not 1; rescale them or pass --no-normalize to apply them as given"
        )
    if not np.any(w != 0):
        raise UpcyclerError("every weight is 0; give at least one input a non-zero weight")
    return tuple(float(x) for x in w)


def _check_specs(items: Sequence[MergeInput], base: Checkpoint | None) -> None:
    """Every input (and the base) has the first input's architecture and tensor shapes."""
    first = items[0]
    others = [(i.label, i.checkpoint) for i in items[1:]]
    if base is not None:
        others.append((str(base.source), base))
    for label, ckpt in others:
        field = first_difference(first.checkpoint.spec, ckpt.spec)
        if field is not None:
            a, b = field_value(first.checkpoint.spec, field), field_value(ckpt.spec, field)
            raise UpcyclerError(
                f"{label}: {field} is {b!r} but {first.label} has {a!r}; "
                "only checkpoints of one architecture can be merged"
            )
        for name, tensor in first.checkpoint.tensors.items():
            other = ckpt.tensors.get(name)
            if other is None or other.shape != tensor.shape:
                found = "missing" if other is None else f"shaped {list(other.shape)}"
                raise UpcyclerError(f"{label}: tensor {name} is {found}, {first.label} has {list(tensor.shape)}")


def first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The dotted name of the first compared field where two ModelSpecs differ, or None if equal."""
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for f in dataclasses.fields(a):
            if f.compare:
                found = first_difference(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
                if found is not None:
                    return found
        return None
    return None if a == b else prefix.rstrip(".")


def field_value(spec: Any, dotted: str) -> Any:
    """The value of the dotted field `dotted` (as `first_difference` names it) of a ModelSpec."""
    for part in dotted.split("."):
        spec = getattr(spec, part)
    return spec


def describe_plan(plan: MergePlan) -> str:
    """What the merge will do, in a few lines, from headers alone: method, weights, inputs, sizes, memory."""
    m = plan.method
    opts = ", ".join(f"{k.rstrip('_')}={v:g}" for k, v in plan.options.items())
    lines = [f"method   {m.name}" + (f" ({opts})" if opts else "") + f": {m.summary}", f"paper    {m.paper}"]
    if m.seeded:
        lines.append(f"seed     {plan.seed}")
    lines.append(f"inputs   {len(plan.inputs)}, oldest first" + ("" if plan.weights else " (unweighted)"))
    lines.append("    #  " + ("weight    " if plan.weights else "") + "step          source")
    for k, item in enumerate(plan.inputs):
        weight = f"{plan.weights[k]:<10.6g}" if plan.weights else ""
        step = f"{item.step:<14d}" if item.step is not None else f"{'-':<14}"
        lines.append(f"  {k + 1:>3}  {weight}{step}{item.label}")
    if plan.base is not None:
        lines.append(f"base     {plan.base.source}")
    lines += _sizes(plan)
    return "\n".join(lines)


def _sizes(plan: MergePlan) -> list[str]:
    spec, tensors = plan.inputs[0].checkpoint.spec, plan.inputs[0].checkpoint.tensors
    dtypes = {dtype_name(plan.dtype or t.dtype) for t in tensors.values()}
    out_bytes = sum(t.numel * (plan.dtype or t.dtype).itemsize for t in tensors.values())
    stacked = stacked_names(spec)
    units = {k: t.numel // t.shape[0] if k in stacked else t.numel for k, t in tensors.items()}
    name = max(units, key=units.__getitem__)
    unit = human_bytes(units[name] * 4)
    held = "a few times that, whatever the number of inputs" if plan.method.streams else \
        f"about {len(plan.inputs)} + a few times that (one copy per input)"
    return [
        f"model    {spec.family}, {human_count(spec.total_params())} parameters, {len(tensors)} tensors",
        f"output   {human_bytes(out_bytes)} as {', '.join(sorted(dtypes))}",
        f"memory   largest unit merged at once: {name}, {unit} in fp32; working memory {held}",
    ]


def stacked_names(spec: ModelSpec) -> set[str]:
    """Canonical names of the expert-stacked tensors, merged one expert at a time."""
    return {d.name for d in declare_params(spec) if d.expert_stacked}
