"""What `dense-to-moe` declares for the command that runs it (`registry.TransformHooks`).

- Inputs: the `--calibration` data and the `--experts-from` models, which an output may not overlap.
- Write check: one exact step from a local HF source to a local HF output is checked in-stream, beside the
  write (`moe_write_check`); any other plan keeps the command's full check.
- After the write: a router pointed at each source's data (`--router-init centroids`) is measured by the
  written model's first forward on that data, with the router inputs the command lends: the share of each
  source's tokens routed to the experts of each source.
- Advisor: `--plan-for TOPOLOGY` and its options (`upcycler.cli.moe_advice`, a command-line module).

A module of its own because the write check imports the transform: `dense_to_moe` cannot import it back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.io import read_checkpoint
from upcycler.transforms.dense_to_moe import CENTROID_SEQUENCES, DenseToMoE
from upcycler.transforms.registry import AfterWrite, TransformContext, TransformHooks, declare


class DenseToMoEHooks(TransformHooks):
    """`dense-to-moe`'s inputs, write check, report after the write and advisor."""

    advisor = "upcycler.cli.moe_advice"

    def inputs(self, config: DenseToMoE) -> list[Path]:
        named = (config.calibration, *(config.experts_from or {}).values())
        return [Path(path) for path in named if path is not None]

    def write_check(self, plan: Any) -> Callable[[Path], dict] | None:
        from upcycler.transforms.moe_write_check import write_check_for

        return write_check_for(plan)

    def after_write(self, plan: Any, step: int, out: Path, lent: TransformContext) -> AfterWrite | None:
        config, name = plan.recipe.steps[step].config, plan.recipe.steps[step].transform.name
        if config.router_init != "centroids" or lent.router_inputs is None:
            return None
        recorded = next(e for e in reversed(plan.ckpt.lineage) if e.get("step") == name and "expert_sources" in e)
        names = list(config.experts_from)
        shares = lent.router_inputs().shares(read_checkpoint(out), Path(config.calibration), names,
                                             recorded["expert_sources"],
                                             config.calibration_sequences or CENTROID_SEQUENCES,
                                             config.calibration_length)
        return AfterWrite("first forward on the calibration data: share of each source's tokens routed to the "
                          f"experts of each source (mean over MoE layers)\n{format_shares(shares, names)}",
                          {"initial_routing": {"sources": names, "per_layer": shares.round(4).tolist()}})


def format_shares(shares: np.ndarray, names: Sequence[str]) -> str:
    """The routing matrix [M, S, S] averaged over MoE layers, one row per data source, for people."""
    mean = shares.mean(0)
    corner = "data \\ experts of"
    first, width = max(len(corner), *(len(n) for n in names)) + 2, max(8, *(len(n) + 2 for n in names))
    lines = [f"{corner:<{first}}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"{n:<{first}}" + "".join(f"{v:>{width}.0%}" for v in row) for n, row in zip(names, mean)]
    return "\n".join(lines)


declare("dense-to-moe", DenseToMoEHooks())
