"""Model merging: PMA-style checkpoint averages and mergekit-class methods, streamed tensor by tensor.

    from upcycler.merge import merge_checkpoints
    merged = merge_checkpoints([read_checkpoint(p) for p in paths], "ema", options={"alpha": 0.2})
    write_checkpoint(merged, "out")          # nothing is read or computed before this line

- `METHODS` is the registry (`registry.py`; a method is added with its `averaging` or `merge_method`
  decorator): sma, ema, wma, linear (`averaging.py`), slerp (`interpolate.py`), task-arithmetic, ties,
  dare-linear, dare-ties, model-stock (`task_vectors.py`); minus-sqrt (WSM) with the averages.
- `plan_merge` checks everything before a tensor is read and `describe_plan` shows the plan (`plan.py`);
  `merge` turns a plan into a lazy `Checkpoint` (`engine.py`).
- `find_checkpoints` picks steps of a training run directory (`runs.py`).
- Memory: the averaging methods, task-arithmetic, dare-linear and model-stock hold a fixed number of
  fp32 copies of one tensor (one expert, for stacked experts) whatever the number of inputs; slerp,
  ties and dare-ties hold one copy per input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from upcycler.io.checkpoint import Checkpoint
from upcycler.merge import averaging, interpolate, task_vectors  # noqa: F401  (fill the registry)
from upcycler.merge.averaging import weighted_average
from upcycler.merge.engine import lineage_step, merge, merge_tensor, tensor_rng
from upcycler.merge.plan import (
    MergeInput,
    MergePlan,
    describe_plan,
    field_value,
    first_difference,
    plan_merge,
)
from upcycler.merge.registry import METHODS, Method, Range, get_method
from upcycler.merge.runs import find_checkpoints

__all__ = [
    "METHODS",
    "MergeInput",
    "MergePlan",
    "Method",
    "Range",
    "describe_plan",
    "field_value",
    "find_checkpoints",
    "first_difference",
    "get_method",
    "lineage_step",
    "merge",
    "merge_checkpoints",
    "merge_tensor",
    "plan_merge",
    "tensor_rng",
    "weighted_average",
]


def merge_checkpoints(inputs: Sequence[Checkpoint | MergeInput], method: str, **kwargs: Any) -> Checkpoint:
    """`merge(plan_merge(inputs, method, **kwargs))`: the merged checkpoint, lazily."""
    return merge(plan_merge(inputs, method, **kwargs))
