"""Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 §2.1.2): the router's selection bias.

Every MoE layer of a model whose router has a selection bias (`MoESpec.router_bias`: GLM-4-MoE's and
DeepSeek-V3's `e_score_correction_bias`) adds the bias to the scores only to choose the top-k experts; the
combine weights stay the unbiased scores (`upcycler.train.model.moe.route`). After each step,

    bias_e ← bias_e + rate · sign(mean_load − load_e)

per layer, with load_e the token copies expert e received in the whole step (all microbatches, every
device): an overloaded expert becomes less likely to be chosen, an idle one more. The bias is a buffer:
the optimiser never sees it (no gradient, no moments, no weight decay), it is saved with the parameters
and exported as the family's bias tensor. The counts are integers summed exactly, so the update is the
same on any number of devices or processes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from upcycler.spec import ModelSpec
from upcycler.train.model.params import Params
from upcycler.train.techniques.in_step import StepTechnique

BIAS_PATH = ("layers", "moe", "moe", "router_bias")  # [M, E]: the MoE layers' selection biases, in order


def has_selection_bias(spec: ModelSpec) -> bool:
    return spec.moe is not None and spec.moe.router_bias


def selection_bias(params: Params) -> jax.Array:
    """The [M, E] selection biases of the MoE layers (the model must have them)."""
    node = params
    for key in BIAS_PATH:
        node = node[key]
    return node


def update_selection_bias(params: Params, counts_ME: jax.Array, rate: float) -> Params:
    """`params` with every layer's selection bias moved by rate · sign(mean load − load), in float32."""
    counts_ME = counts_ME.astype(jnp.float32)
    bias_ME = selection_bias(params)
    step_ME = jnp.sign(counts_ME.mean(axis=-1, keepdims=True) - counts_ME)
    new_bias = (bias_ME + jnp.float32(rate) * step_ME).astype(bias_ME.dtype)
    moe = params["layers"]["moe"]
    return {**params, "layers": {**params["layers"], "moe": {**moe, "moe": {**moe["moe"], "router_bias": new_bias}}}}


class SelectionBiasBalancing(StepTechnique):
    """In the step, for a model with a selection bias: the bias the step routed with, as the metric
    `selection_bias`, and (`loss.bias_update` on, `loss.bias_update_rate` > 0) its update from the step's
    expert counts, applied to the parameters after the optimiser's."""

    name = "selection-bias balancing"

    def __init__(self, rate: float):
        self.rate = rate

    @classmethod
    def from_run(cls, config: Any, spec: ModelSpec) -> SelectionBiasBalancing | None:
        if not has_selection_bias(spec):
            return None
        loss = config.loss
        return cls(loss.bias_update_rate if loss.bias_update == "on" else 0.0)

    def after_update(self, before: Any, after: Any, metrics: dict[str, jax.Array]) -> Any:
        metrics["selection_bias"] = selection_bias(before.params)
        if self.rate > 0:
            after = replace(after, params=update_selection_bias(after.params, metrics["expert_counts"], self.rate))
        return after
