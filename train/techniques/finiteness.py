"""The finiteness check: a step whose loss or gradient norm is NaN or infinite stops the run.

The check comes after the step's metrics are back and before anything of the step is saved: the run
ends with one line naming the step and the last good checkpoint. A step the loss-spike guard
(`spike_guard`) already discarded is left to it (a non-finite loss is a spike there).
"""

from __future__ import annotations

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.techniques.protocol import StepContext, Technique


class FinitenessCheck(Technique):
    """Stops the run (before anything of the step is saved) when its loss or gradient norm is not finite."""

    def after_step(self, ctx: StepContext) -> None:
        raw = ctx.raw
        if ctx.discarded is not None or (np.isfinite(raw["total_loss"]) and np.isfinite(raw["grad_norm"])):
            return
        last = ctx.last_checkpoint
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        raise UpcyclerError(
            f"loss is {float(raw['total_loss'])} (grad norm {float(raw['grad_norm'])}) at step "
            f"{ctx.step}; stopped without saving it; {where}; lower optimizer.lr or check the data, "
            "then resume"
        )
