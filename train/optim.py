"""The optimiser: AdamW with global-norm clipping and a learning-rate schedule joined from phases.

The schedule is a pure function of the absolute step, so a run resumed at any step (mid-warmup,
mid-anneal) continues on exactly the curve an uninterrupted run follows, and a resumed run may also be
given a new schedule (anneal a checkpoint that was trained at constant lr) while keeping its optimiser
state. Phases (`optimizer.schedule` in the config):

    warmup    linear from the previous phase's end value (0 for a first phase) up to `lr` (default: peak)
    constant  holds `lr` (default: the value the previous phase ended at; the peak for a first phase)
    linear    linear anneal to `lr` (default 0)
    cosine    half-cosine anneal to `lr` (default 0)

Phase k covers steps [previous until_step, until_step) and reaches its end value at its last step; after
the last phase the last value holds. An empty schedule is the constant peak learning rate.

Master weights are float32 (the model casts them to the compute dtype where they are used), and so are the
gradients and both Adam moments. Buffers (the sigmoid router's selection bias) get no update, and weight
decay applies to matrices only, never to norms, biases or buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from upcycler.spec import ModelSpec
from upcycler.train.config import OptimizerConfig
from upcycler.train.model.params import ParamInfo, Params, declare_tree

Schedule = Callable[[Any], jax.Array]


def phase_values(o: OptimizerConfig) -> list[tuple[str, int, int, float, float]]:
    """The schedule as (kind, start step, end step, start lr, end lr) pieces, defaults filled in."""
    pieces = []
    start = 0
    value = 0.0 if o.schedule and o.schedule[0].kind == "warmup" else o.lr
    for phase in o.schedule:
        if phase.lr is not None:
            end_lr = phase.lr
        else:
            end_lr = {"warmup": o.lr, "constant": value, "linear": 0.0, "cosine": 0.0}[phase.kind]
        begin = end_lr if phase.kind == "constant" else value
        pieces.append((phase.kind, start, phase.until_step, begin, end_lr))
        start, value = phase.until_step, end_lr
    return pieces


def make_schedule(o: OptimizerConfig) -> Schedule:
    """The learning rate at an absolute step (traceable: works on ints and on jax scalars)."""
    pieces = phase_values(o)
    final = pieces[-1][4] if pieces else o.lr

    def schedule(step: Any) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        lr = jnp.asarray(final, jnp.float32)
        for kind, start, end, lr0, lr1 in reversed(pieces):
            frac = jnp.clip((s - start + 1) / (end - start), 0.0, 1.0)
            if kind == "cosine":
                value = lr1 + (lr0 - lr1) * 0.5 * (1 + jnp.cos(math.pi * frac))
            elif kind == "constant":
                value = jnp.asarray(lr1, jnp.float32)
            else:
                value = lr0 + (lr1 - lr0) * frac
            lr = jnp.where(s < end, value, lr)
        return lr

    return schedule


def trainable_mask(spec: ModelSpec) -> Params:
    """True for every leaf the optimiser may change (everything but buffers)."""
    return jax.tree.map(lambda info: not info.is_buffer, declare_tree(spec), is_leaf=_is_info)


def decay_mask(spec: ModelSpec) -> Params:
    """True for the leaves that get weight decay: trainable matrices (2+ axes besides the layer axis)."""

    def decays(info: ParamInfo) -> bool:
        axes = info.axes[1:] if info.stacked else info.axes
        return len(axes) >= 2 and not info.is_buffer

    return jax.tree.map(decays, declare_tree(spec), is_leaf=_is_info)


def make_optimizer(o: OptimizerConfig, spec: ModelSpec) -> tuple[optax.GradientTransformation, Schedule]:
    """(AdamW with clipping and the schedule, the schedule itself). The update count is the step.

    The state's structure does not depend on the hyperparameters, so a checkpoint resumes under a changed
    learning rate, schedule, clipping or weight decay."""
    schedule = make_schedule(o)
    frozen = jax.tree.map(lambda t: not t, trainable_mask(spec))
    clip = optax.clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity()
    adamw = optax.adamw(
        schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask(spec)
    )
    return optax.chain(optax.masked(optax.set_to_zero(), frozen), clip, adamw), schedule


def grad_norm(grads: Params, spec: ModelSpec) -> jax.Array:
    """Global L2 norm of the trainable gradients (before clipping), in fp32."""
    kept = jax.tree.map(lambda g, t: g if t else jnp.zeros_like(g), grads, trainable_mask(spec))
    return optax.tree.norm(kept)


def opt_state_shardings(
    tx: optax.GradientTransformation, abstract_params: Params, param_shardings: Params, mesh: Mesh
) -> Any:
    """Shardings of the optimiser state: moments like their parameters, counters replicated."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )


def _is_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)
