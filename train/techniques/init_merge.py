"""`model.init_from_merge`: start a run from an average of checkpoints (PMA's merged initialisation).

The section (`config.InitMergeConfig`) names the checkpoints in `upcycle merge`'s own terms: sources (run
directories or checkpoints), the steps to take from them (`last`, `every`, `until`), an averaging `method`
(sma, ema, wma, minus-sqrt) and its option (`alpha`, for ema), e.g. `{sources: [runs/a], last: 3, method:
sma}`. `plan_init_merge` checks it all (the steps exist, the architectures agree with `model.init`) reading
only checkpoint headers; the merged tensors are computed lazily when the trainer loads them, one tensor at
a time, and the merge is recorded in the run's lineage like an `upcycle merge` output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.io.checkpoint import Checkpoint
from upcycler.merge import METHODS, MergeInput, find_checkpoints, first_difference, merge, plan_merge
from upcycler.spec import ModelSpec

OPTION = "model.init_from_merge"


def merge_sources(section: Any) -> list[Path]:
    """The run directories or checkpoints `section` (an `InitMergeConfig`) averages; refused when none."""
    if not section.sources:
        raise UpcyclerError(f"{OPTION}.sources is empty: name a run directory or checkpoints to average")
    return [Path(source) for source in section.sources]


def method_options(section: Any) -> dict[str, Any]:
    """The averaging method's options the section sets (`alpha`: ema's), refused on a method without it."""
    names = {arg.name for arg in METHODS[section.method].args}
    if section.alpha is not None and "alpha" not in names:
        raise UpcyclerError(f"{OPTION}.alpha is an option of method ema, not {section.method}; drop it or "
                            "set method: ema")
    return {} if section.alpha is None else {"alpha": section.alpha}


def plan_init_merge(section: Any, spec: ModelSpec) -> Checkpoint:
    """The merged checkpoint (lazy) `section` (an `InitMergeConfig`) describes, checked against `spec`."""
    paths, options = merge_sources(section), method_options(section)
    steps = {k: v for k, v in (("last", section.last), ("every", section.every), ("until", section.until))
             if v is not None}
    try:
        found = find_checkpoints(paths, **steps)
        plan = plan_merge([MergeInput(read_checkpoint(p), step) for p, step in found], section.method,
                          options=options)
    except UpcyclerError as err:  # the merge's own words, said of this option
        raise UpcyclerError(f"{OPTION}: {err}") from None
    merged = merge(plan)
    if merged.spec != spec:
        where = first_difference(merged.spec, spec) or "the architecture"
        raise UpcyclerError(f"{OPTION}: the checkpoints to average differ from model.init in {where}; average "
                            "checkpoints of model.init's architecture")
    return merged
