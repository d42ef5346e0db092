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

`optimizer.trainable` freezes parameters row by row (a row: one layer of a stacked leaf): `all`, the
blocks depth growth inserted (`new_layers`, read from the init checkpoint's lineage), or the tensors whose
canonical name a regex finds. Frozen rows have no optimiser state: the update gathers the trainable rows
(static indices), runs clipping and AdamW on them alone (the clipping norm counts only them) and scatters
the result back, so a frozen row never changes by a bit and a leaf with no trainable row keeps no state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from upcycler.spec import ModelSpec
from upcycler.train.config import OptimizerConfig
from upcycler.train.loop.trainable import new_layer_set, nothing_matches, search
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


def trainable_rows(o: OptimizerConfig, spec: ModelSpec, lineage: Sequence[Mapping[str, Any]] = ()) -> Params | None:
    """Which rows (layers of a stacked leaf) `optimizer.trainable` lets the optimiser change; None: all.

    A tree like the parameters: per stacked leaf a numpy bool array over its rows, per other leaf a numpy
    bool scalar. Buffers never train. `lineage` (the init checkpoint's) says which layers are new."""
    if o.trainable == "all":
        return None
    if o.trainable == "new_layers":
        layers = new_layer_set(spec, lineage)
        trains = lambda name: _layer(name) in layers
    else:  # every name searched once, within a time bound (a backtracking pattern is refused, not hung on)
        names = [name for info in jax.tree.leaves(declare_tree(spec), is_leaf=_is_info) for name in info.names]
        found = dict(zip(names, search(o.trainable, names)))
        trains = found.__getitem__

    def rows(info: ParamInfo) -> np.ndarray:
        kept = np.array([trains(name) and not info.is_buffer for name in info.names], bool)
        return kept if info.stacked else kept[0]

    out = jax.tree.map(rows, declare_tree(spec), is_leaf=_is_info)
    if not any(r.any() for r in jax.tree.leaves(out)):
        raise nothing_matches(o.trainable)
    return out


def _layer(name: str) -> int | None:
    """The layer index of a canonical tensor name (`layers.{i}.…`), None outside the layers."""
    parts = name.split(".", 2)
    return int(parts[1]) if parts[0] == "layers" else None


def keep_trainable(grads: Params, rows: Params | None) -> Params:
    """`grads` with the rows `trainable_rows` freezes set to zero (unchanged when `rows` is None)."""
    if rows is None:
        return grads

    def keep(r: np.ndarray, g: jax.Array) -> jax.Array:
        if r.all():
            return g
        if not r.any():
            return jnp.zeros_like(g)
        return jnp.where(r.reshape(-1, *(1,) * (g.ndim - 1)), g, jnp.zeros((), g.dtype))

    return jax.tree.map(keep, rows, grads)


class TrainableRowsState(NamedTuple):
    """The state of `only_rows`: the inner state, over the trainable rows alone."""

    inner_state: optax.OptState


def only_rows(inner: optax.GradientTransformation, rows: Params) -> optax.GradientTransformation:
    """`inner` applied to the trainable rows of every leaf (`trainable_rows`); its state holds only those.

    Per leaf: all rows train: the leaf as it is; none: an `optax.MaskedNode` (no state at all); some: the
    rows at static indices. Frozen rows get the update -0.0, which leaves every float bit for bit
    (x + -0.0 == x, signed zeros included), so they never change, whatever the decay or the gradients."""

    def gather(r: np.ndarray, x: Any) -> Any:
        if r.all():
            return x
        if not r.any():
            return optax.MaskedNode()
        return jnp.take(x, np.flatnonzero(r), axis=0, indices_are_sorted=True, unique_indices=True)

    def scatter(r: np.ndarray, u: Any, like: jax.Array) -> jax.Array:
        if r.all():
            return u
        frozen = jnp.full_like(like, -0.0)
        if not r.any():
            return frozen
        return frozen.at[np.flatnonzero(r)].set(u.astype(like.dtype), indices_are_sorted=True, unique_indices=True)

    def init(params: Params) -> TrainableRowsState:
        if not isinstance(params, Mapping):  # `optax.tree_map_params` probes `init` with a placeholder
            return TrainableRowsState(inner.init(params))
        return TrainableRowsState(inner.init(jax.tree.map(gather, rows, params)))

    def update(updates: Params, state: TrainableRowsState, params: Params | None = None):
        kept = None if params is None else jax.tree.map(gather, rows, params)
        new, inner_state = inner.update(jax.tree.map(gather, rows, updates), state.inner_state, kept)
        return jax.tree.map(scatter, rows, new, updates), TrainableRowsState(inner_state)

    return optax.GradientTransformation(init, update)


def make_optimizer(o: OptimizerConfig, spec: ModelSpec, lineage: Sequence[Mapping[str, Any]] = ()
                   ) -> tuple[optax.GradientTransformation, Schedule]:
    """(AdamW with clipping and the schedule, the schedule itself). The update count is the step.

    The state's structure does not depend on the hyperparameters, so a checkpoint resumes under a changed
    learning rate, schedule, clipping or weight decay; it does depend on `optimizer.trainable` (moments of
    the trainable rows only, see `only_rows`)."""
    schedule = make_schedule(o)
    clip = optax.clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity()
    adamw = optax.adamw(
        schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask(spec)
    )
    rows = trainable_rows(o, spec, lineage)
    if rows is not None:
        return only_rows(optax.chain(clip, adamw), rows), schedule
    frozen = jax.tree.map(lambda t: not t, trainable_mask(spec))
    return optax.chain(optax.masked(optax.set_to_zero(), frozen), clip, adamw), schedule


def grad_norm(grads: Params, spec: ModelSpec) -> jax.Array:
    """Global L2 norm of the trainable gradients (before clipping), in fp32."""
    kept = jax.tree.map(lambda g, t: g if t else jnp.zeros_like(g), grads, trainable_mask(spec))
    return optax.tree.norm(kept)


def opt_state_shardings(
    tx: optax.GradientTransformation, abstract_params: Params, param_shardings: Params, mesh: Mesh
) -> Any:
    """Shardings of the optimiser state: moments like their parameters, counters replicated.

    Moments of some rows only (`only_rows`) take their parameter's sharding as it is: the layer axis is
    never split (`sharding.RULES`), so fewer rows change nothing; a leaf without state stays a MaskedNode."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda leaf, sharding: leaf if isinstance(leaf, optax.MaskedNode) else sharding,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )


def _is_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)
