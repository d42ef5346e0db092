"""Turn a checked `MergePlan` into a lazy `Checkpoint`: nothing is read or computed until it is written.

Each output tensor is a `LazyTensor` whose bytes are the merge of the inputs' tensors of that name;
expert-stacked tensors are stacks whose `part(e)` merges expert e only (reading expert e of each input),
so a writer going expert by expert never holds a whole stacked tensor. Inputs are read, converted to
fp32 and merged by the method; the result is cast once to the output dtype (the first input's, unless
the plan sets one). The next input is read on a worker thread while the current one is merged, so the
averaging methods hold one fp32 accumulator and at most two inputs, whatever their number.

The merge step recorded in the lineage names every input with its step and its own lineage, the
method, its options, the weights, the base and (for methods that draw random numbers) the seed, so a
merge can be repeated exactly.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from upcycler.io.checkpoint import Checkpoint
from upcycler.io.manifest import MergeStep, merge_step
from upcycler.locations import recorded_location
from upcycler.merge.averaging import weighted_average
from upcycler.merge.plan import MergePlan, stacked_names
from upcycler.tensors import LazyTensor, TensorMap, dtype_name, read_ahead, stack


def merge(plan: MergePlan) -> Checkpoint:
    """The merged checkpoint, lazily; its lineage ends with one `{"step": "merge", …}` entry."""
    first = plan.inputs[0].checkpoint
    stacked = stacked_names(first.spec)
    tensors = TensorMap({name: _merged(plan, name, t, name in stacked) for name, t in first.tensors.items()})
    side = (plan.base or first).side_files
    read = [i.checkpoint for i in plan.inputs] + ([plan.base] if plan.base else [])
    start = Checkpoint(first.spec, TensorMap(), None, (), side,
                       inputs=tuple(dict.fromkeys(p for c in read for p in c.inputs)),
                       watches=tuple(w for c in read for w in c.watches))
    return start.with_step(lineage_step(plan), first.spec, tensors)


def tensor_rng(seed: int, name: str, part: int | None) -> np.random.Generator:
    """The random generator of one tensor (or one expert): depends only on seed, canonical name, part."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), (-1 if part is None else part) + 1])


def lineage_step(plan: MergePlan) -> MergeStep:
    """The lineage entry of this merge (JSON-ready)."""
    details: dict[str, Any] = {}
    if plan.base is not None:
        details["base"] = {"source": recorded_location(plan.base.source), "lineage": list(plan.base.lineage)}
    if plan.method.seeded:
        details["seed"] = plan.seed
    if plan.dtype is not None:
        details["dtype"] = dtype_name(plan.dtype)
    return merge_step(plan.method.name, {k.rstrip("_"): v for k, v in plan.options.items()}, plan.weights,
                      [{"source": i.label, "step": i.step, "lineage": list(i.checkpoint.lineage)}
                       for i in plan.inputs], **details)


def _merged(plan: MergePlan, name: str, like: LazyTensor, is_stacked: bool) -> LazyTensor:
    dtype = plan.dtype or like.dtype
    if is_stacked:
        parts = [partial(merge_tensor, plan, name, e, dtype) for e in range(like.shape[0])]
        return stack(parts, like.shape, dtype)
    return LazyTensor(like.shape, dtype, partial(merge_tensor, plan, name, None, dtype))


def merge_tensor(plan: MergePlan, name: str, part: int | None, dtype: np.dtype) -> np.ndarray:
    """The merge of tensor `name` (or of its expert `part`) over the plan's inputs, as `dtype`."""

    def reader(ckpt: Checkpoint, fp32: bool = False) -> Callable[[], np.ndarray]:
        tensor = ckpt.tensors[name]
        read = tensor.load if part is None else partial(tensor.part, part)
        return (lambda: np.array(read(), dtype=np.float32)) if fp32 else read

    m = plan.method
    if m.kind == "average":  # accumulates in fp32 and writes `dtype` in its last pass
        used = [(i.checkpoint, w) for i, w in zip(plan.inputs, plan.weights, strict=True) if w != 0]
        return weighted_average(read_ahead([reader(c) for c, _ in used]), [w for _, w in used], dtype)
    kwargs: dict[str, Any] = dict(plan.options)
    if m.needs_base:
        kwargs["base"] = reader(plan.base, fp32=True)()
    if m.weights != "none":
        kwargs["weights"] = np.asarray(plan.weights, dtype=np.float64)
    if m.seeded:
        kwargs["rng"] = tensor_rng(plan.seed, name, part)
    arrays = read_ahead([reader(i.checkpoint, fp32=True) for i in plan.inputs])  # fresh copies
    return m.fn(arrays, **kwargs).astype(dtype, copy=False)


