"""`loss.z_coef_ramp`: the router z-loss's coefficient raised linearly over the first steps of a run.

A freshly upcycled router copies one set of logits into every expert's (or starts from centroids): its
logits are small and the z-loss (ST-MoE, arXiv 2202.08906), which keeps them from growing, has nothing to
hold back yet; a full coefficient from step 0 only pulls a router that has not learned to route. With
`loss.z_coef_ramp: N` step s (0-based) weighs the z-loss by z_coef · min(1, (s + 1) / N): a tenth of it
at step 0 of a 10-step ramp, all of it from step N − 1 on. The coefficient is a traced value of the step
(`in_step.StepTechnique.values`), so one compiled step serves every step of the ramp; its value is
logged as `technique/z_coef`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from upcycler.train.techniques.in_step import METRIC_PREFIX, StepTechnique


class ZLossRamp(StepTechnique):
    """The z-loss coefficient of each step, rising over `steps` steps to `coef`."""

    name = "z-loss ramp"

    def __init__(self, coef: float, steps: int):
        self.coef, self.steps = coef, steps

    @classmethod
    def from_run(cls, config: Any, spec: Any) -> ZLossRamp | None:
        loss = config.loss
        return cls(loss.z_coef, loss.z_coef_ramp) if loss.z_coef_ramp > 0 and spec.moe is not None else None

    def values(self, step: jax.Array) -> dict[str, jax.Array]:
        done = (jnp.asarray(step, jnp.float32) + 1) / jnp.float32(self.steps)
        return {"z_coef": jnp.float32(self.coef) * jnp.minimum(done, 1.0)}

    def after_update(self, before: Any, after: Any, metrics: dict[str, jax.Array]) -> Any:
        metrics[METRIC_PREFIX + "z_coef"] = self.values(before.step)["z_coef"]
        return after
