"""The loss and the jitted train step: forward, cross-entropy + router losses, gradients, AdamW update.

Everything here is a pure function of (state, batch), compiled once with explicit shardings: the state
(parameters and optimiser state) laid out by `upcycler.train.sharding`, the batch split over every mesh
axis, the metrics replicated so every process can read them. The state is donated, so a step needs no
second copy of the parameters.

Shape suffixes follow the dimension key of `upcycler.train.model` (here: B, L, V, M, E, k).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from upcycler.spec import ModelSpec
from upcycler.train import model as model_lib
from upcycler.train import sharding
from upcycler.train.config import LossConfig
from upcycler.train.model import moe
from upcycler.train.model.params import Params
from upcycler.train.optim import Schedule, grad_norm

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "mask", "source_id")


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Step counter (int32 scalar: steps done), float32 parameters and the optax state."""

    step: jax.Array
    params: Params
    opt_state: Any


def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood [B, L] in fp32."""
    logits_BLV = logits_BLV.astype(jnp.float32)
    target_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BLV, axis=-1) - target_BL


def router_terms(aux: model_lib.Aux, mask_BL: jax.Array, spec: ModelSpec) -> dict[str, jax.Array]:
    """Load-balancing loss (1.0 when balanced) and z-loss, each the mean over MoE layers, over the whole
    batch's real tokens; and the token copies each expert received, per layer [M, E]."""
    E, kind = spec.moe.num_experts, spec.moe.router  # type: ignore[union-attr]

    def one_layer(logits_BLE: jax.Array, ids_BLk: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        lb = moe.load_balancing_loss(logits_BLE, ids_BLk, mask_BL, E, "batch", router_kind=kind)
        return lb, moe.router_z_loss(logits_BLE, mask_BL), moe.expert_load(ids_BLk, mask_BL, E)

    lb_M, z_M, counts_ME = jax.vmap(one_layer)(aux.router_logits, aux.expert_ids)
    return {"lb_loss": lb_M.mean(), "z_loss": z_M.mean(), "expert_counts": counts_ME}


def loss_fn(
    params: Params,
    batch: Batch,
    *,
    spec: ModelSpec,
    cfg: model_lib.ModelConfig,
    loss: LossConfig,
    num_sources: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(total loss, metrics): masked mean cross-entropy over the whole batch plus weighted router losses."""
    logits_BLV, aux = model_lib.forward(params, batch["inputs"], spec, cfg)
    mask_BL = batch["mask"].astype(jnp.float32)
    nll_BL = cross_entropy(logits_BLV, batch["targets"]) * mask_BL
    tokens = mask_BL.sum()
    ce = nll_BL.sum() / jnp.maximum(tokens, 1.0)
    metrics = {
        "loss": ce,
        "tokens": tokens,
        "source_loss": jax.ops.segment_sum(nll_BL.sum(-1), batch["source_id"], num_sources),
        "source_tokens": jax.ops.segment_sum(mask_BL.sum(-1), batch["source_id"], num_sources),
    }
    total = ce
    if aux.router_logits is not None:
        terms = router_terms(aux, mask_BL, spec)
        total = total + loss.lb_coef * terms["lb_loss"] + loss.z_coef * terms["z_loss"]
        metrics.update(lb_loss=terms["lb_loss"], z_loss=terms["z_loss"], expert_counts=terms["expert_counts"])
    metrics["total_loss"] = total
    return total, metrics


def make_train_step(
    spec: ModelSpec,
    cfg: model_lib.ModelConfig,
    loss: LossConfig,
    tx: optax.GradientTransformation,
    schedule: Schedule,
    num_sources: int,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The (unjitted) step: gradients of `loss_fn`, clipped AdamW update, metrics of the step."""

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(
            state.params, batch, spec=spec, cfg=cfg, loss=loss, num_sources=num_sources
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics.update(grad_norm=grad_norm(grads, spec), lr=schedule(state.step))
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


def batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
    """Every batch array split on its first (row) axis over the batch mesh axes."""
    return {k: sharding.batch_sharding(mesh, 1 if k == "source_id" else 2) for k in BATCH_KEYS}


def compile_step(step: Callable, state_shardings: TrainState, mesh: Mesh, state: TrainState, batch: Batch):
    """AOT-compile `step` for these shardings (donating the state); metrics come out replicated."""
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, batch_shardings(mesh)),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )
    with jax.set_mesh(mesh):
        return jitted.lower(state, batch).compile()


def global_batch(local: dict[str, Any], mesh: Mesh) -> Batch:
    """This process's rows (numpy) as global arrays sharded over the mesh."""
    shardings = batch_shardings(mesh)
    return {k: jax.make_array_from_process_local_data(shardings[k], local[k]) for k in BATCH_KEYS}
