"""A loss-spike rewind carried out (`upcycler.train.techniques.spike_guard` decides it, as a `Rewind`
action): the checkpoints saved from the spiked state are deleted, the weights become the mean of the
chosen good checkpoints, and the optimiser state and EMA are the newest one's, its update counters set to
the step the run goes on from (so the learning-rate schedule and Adam's bias correction go on from there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.train.loop.checkpointing import RunCheckpoints
from upcycler.train.loop.train_step import StateLayout, TrainState


def rewound_state(ckpts: RunCheckpoints, layout: StateLayout, to: Sequence[int], step: int) -> TrainState:
    """The state after spiking step `step`, rewound to the average of checkpoints `to` (oldest first): its
    step is `step` + 1 (the data goes on; the spiking batch is skipped, not replayed)."""
    for n in ckpts.committed():
        if n >= step:
            ckpts.delete(n)
    abstract = layout.abstract
    newest = ckpts.restore(to[-1], abstract.params, abstract.opt_state, with_ema=abstract.ema is not None)
    params = mean([ckpts.restore_params(n, abstract.params) for n in to[:-1]] + [newest.params])
    opt_state = with_count(newest.opt_state, step + 1)  # the schedule reads the optimiser's own count
    return TrainState(jnp.asarray(step + 1, jnp.int32), params, opt_state, newest.ema)


def with_count(opt_state: Any, count: int) -> Any:
    """`opt_state` with every update counter (optax's `count` fields) set to `count`: the learning-rate
    schedule and Adam's bias correction then go on from the step the run is at."""

    def reset(path, leaf):
        named = getattr(path[-1], "name", None) if path else None
        return jnp.full_like(leaf, count) if named == "count" else leaf

    return jax.tree_util.tree_map_with_path(reset, opt_state)


def mean(trees: list[Any]) -> Any:
    """The element-wise mean of parameter trees, as a float32 running mean (one accumulator)."""
    running = trees[0]
    for i, tree in enumerate(trees[1:], start=2):
        share = np.float32(1 / i)
        running = jax.tree.map(lambda m, x, c=share: m + (x - m) * c, running, tree)
    return running
