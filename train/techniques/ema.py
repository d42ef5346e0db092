"""The exponential moving average of the weights, kept during training (`optimizer.ema`).

With decay β and θ_t the parameters after update t (t = 1, 2, …), the average after step t is

    ema_t = Σ_{i=1..t} (1−β)·β^(t−i)·θ_i / Σ_{i=1..t} (1−β)·β^(t−i)

the bias-corrected EMA (as Adam corrects its moments), computed as a running weighted mean:
ema_t = ema_{t−1} + c_t·(θ_t − ema_{t−1}) with c_t = (1−β)/(1−β^t), so ema_1 = θ_1 exactly. These are
the weights `upcycle merge --method ema --alpha 1−β` gives the checkpoints of steps 1…t (PMA's EMA with
its weights normalised over the checkpoints at hand): saved every step, the in-training average and the
merge agree to float32 rounding, and the online one costs no checkpoints. It is float32, laid out like
the parameters, saved with every checkpoint (`ema/`) and exported with `upcycle convert --weights ema`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from upcycler.train.model.params import Params
from upcycler.train.techniques.in_step import StepTechnique


def ema_update(ema: Params, params: Params, updates_done: jax.Array, decay: float) -> Params:
    """The average after update number `updates_done` (≥ 1) has produced `params`."""
    t = jnp.asarray(updates_done, jnp.float32)
    beta = jnp.float32(decay)
    c = (1 - beta) / (1 - beta**t)
    return jax.tree.map(lambda e, p: jnp.where(t == 1, p, e + c * (p - e)), ema, params)


class WeightsAverage(StepTechnique):
    """In the step (`optimizer.ema` > 0): the average moved to the parameters the update produced."""

    name = "weights average"

    def __init__(self, decay: float):
        self.decay = decay

    @classmethod
    def from_run(cls, config: Any, spec: Any) -> WeightsAverage | None:
        return cls(config.optimizer.ema) if config.optimizer.ema > 0 else None

    def after_update(self, before: Any, after: Any, metrics: dict[str, jax.Array]) -> Any:
        if after.ema is None:  # a state laid out without an average (`train_step.state_layout`)
            return after
        return replace(after, ema=ema_update(after.ema, after.params, before.step + 1, self.decay))
