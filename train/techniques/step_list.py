"""The in-step techniques a run may use (`in_step.StepTechnique`), in the order they apply in the step."""

from __future__ import annotations

from typing import Any

from upcycler.train.techniques.balancing import SelectionBiasBalancing
from upcycler.train.techniques.ema import WeightsAverage
from upcycler.train.techniques.in_step import StepTechnique
from upcycler.train.techniques.z_loss_ramp import ZLossRamp

# the selection bias moves before the moving average takes the parameters
STEP_TECHNIQUES: tuple[type[StepTechnique], ...] = (SelectionBiasBalancing, WeightsAverage, ZLossRamp)


def for_run(config: Any, spec: Any) -> list[StepTechnique]:
    """The in-step techniques `config` (a `TrainConfig`) turns on for a model of `spec`, in order."""
    chosen = (t.from_run(config, spec) for t in STEP_TECHNIQUES)
    return [t for t in chosen if t is not None]
