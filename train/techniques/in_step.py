"""The in-step half of the technique protocol: what a technique does inside the compiled train step.

The loop's techniques (`protocol.Technique`) run on the host between steps. A `StepTechnique` is traced
and compiled with the step (`upcycler.train.loop.train_step.make_train_step`), at two points of it:

    values(step)                      traced values for this step, handed to the forward in one dict
                                      (`StepValues`): the forward reads the keys it declares
                                      (`train_step.FORWARD_VALUES`, e.g. a loss coefficient) and a key
                                      it does not read is refused when the step is built
    after_update(before, after, m)    the train state after the optimiser's update (`after`; `before` is
                                      the step's input state), adjusted: parameters the optimiser does
                                      not own (a buffer), statistics of the parameters (a moving
                                      average); and the step's metrics `m` with its own figures added
                                      (a scalar named `technique/<name>` is logged with the step)

A run's in-step techniques are `step_list.for_run(config, spec)`, in the order they apply: a later one
sees the state an earlier one left (the selection bias moves before the moving average takes the
parameters). Adding one: a module here with a `StepTechnique` whose `from_run` reads its config key, and
its entry in `step_list.STEP_TECHNIQUES`.

This module imports nothing of the loop: a technique is read and tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import jax

StepValues = Mapping[str, jax.Array]  # per-step traced values handed to the forward, by name
METRIC_PREFIX = "technique/"  # a step metric so named is a scalar the log keeps (reporting.metrics.TECHNIQUE_PREFIX)


class StepTechnique:
    """One technique inside the step; the defaults do nothing, so a technique implements what it needs."""

    name: ClassVar[str] = "technique"

    @classmethod
    def from_run(cls, config: Any, spec: Any) -> StepTechnique | None:
        """This technique for a run of `config` (a `TrainConfig`) on a model of `spec`, or None when the
        run does not use it."""
        return None

    def values(self, step: jax.Array) -> dict[str, jax.Array]:
        """Traced values the forward reads at `step` (the int32 count of steps done before this one)."""
        return {}

    def after_update(self, before: Any, after: Any, metrics: dict[str, jax.Array]) -> Any:
        """The state after the update (`after`, a `TrainState`), adjusted; may add to `metrics`."""
        return after


def step_values(techniques: list[StepTechnique], step: jax.Array, known: tuple[str, ...]) -> dict[str, jax.Array]:
    """Every technique's values for `step`, merged; a key the forward does not read (not in `known`) or
    one two techniques set is refused (a programming error, raised when the step is traced)."""
    merged: dict[str, jax.Array] = {}
    for t in techniques:
        for key, value in t.values(step).items():
            if key not in known:
                raise ValueError(f"technique {t.name} sets {key!r}, which the forward does not read {known}")
            if key in merged:
                raise ValueError(f"technique {t.name} sets {key!r}, set by another technique already")
            merged[key] = value
    return merged
