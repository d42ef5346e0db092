"""The loss and the jitted train step: forward, cross-entropy + router losses, gradients, AdamW update.

Everything here is a pure function of (state, batch), compiled once with explicit shardings: the state
(parameters and optimiser state) laid out by `upcycler.train.loop.sharding`, the batch split over every mesh
axis, the metrics replicated so every process can read them. The state is donated, so a step needs no
second copy of the parameters.

Shape suffixes follow the dimension key of `upcycler.train.model` (here: B, L, V, M, E, k).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from upcycler.spec import ModelSpec
from upcycler.train import model as model_lib
from upcycler.train.config import LossConfig, OptimizerConfig
from upcycler.train.loop import context_parallel, sharding
from upcycler.train.loop.mesh import data_shard
from upcycler.train.loop.optim import (
    Schedule,
    grad_norm,
    keep_trainable,
    make_optimizer,
    opt_state_shardings,
    trainable_rows,
)
from upcycler.train.model import moe
from upcycler.train.model.params import ParamInfo, Params, abstract_params, declare_tree
from upcycler.train.techniques import in_step
from upcycler.train.techniques.in_step import StepTechnique, StepValues

Batch = dict[str, jax.Array]
FORWARD_VALUES = ("lb_coef", "z_coef")  # the in-step techniques' values `loss_fn` reads: the router losses' weights
BATCH_KEYS = ("inputs", "targets", "mask", "source_id")


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Step counter (int32 scalar: steps done), float32 parameters, the optax state and, with
    `optimizer.ema`, the float32 moving average of the parameters (`upcycler.train.techniques.ema`; else None)."""

    step: jax.Array
    params: Params
    opt_state: Any
    ema: Params | None = None


def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood [B, L] in fp32."""
    logits_BLV = logits_BLV.astype(jnp.float32)
    target_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BLV, axis=-1) - target_BL


def router_terms(
    aux: model_lib.Aux, mask_BL: jax.Array, spec: ModelSpec, source_B: jax.Array, num_sources: int
) -> dict[str, jax.Array]:
    """Load-balancing loss (1.0 when balanced) and z-loss, each the mean over MoE layers, over the whole
    batch's real tokens; the token copies each expert received, per layer [M, E], and the same split by
    the data source of the token's row, per layer [M, S, E] (`expert_load_by_source`); and the mean over
    real tokens of the entropy (nats) of the router's distribution over experts, per layer [M]."""
    E, kind = spec.moe.num_experts, spec.moe.router  # type: ignore[union-attr]

    def one_layer(logits_BLE: jax.Array, ids_BLk: jax.Array) -> tuple[jax.Array, ...]:
        lb = moe.load_balancing_loss(logits_BLE, ids_BLk, mask_BL, E, "batch", router_kind=kind)
        entropy = router_entropy(logits_BLE, mask_BL, kind)
        counts_E = moe.expert_load(ids_BLk, mask_BL, E)
        counts_SE = expert_load_by_source(ids_BLk, mask_BL, source_B, num_sources, E)
        return lb, moe.router_z_loss(logits_BLE, mask_BL), counts_E, counts_SE, entropy

    lb_M, z_M, counts_ME, counts_MSE, entropy_M = jax.vmap(one_layer)(aux.router_logits, aux.expert_ids)
    return {"lb_loss": lb_M.mean(), "z_loss": z_M.mean(), "expert_counts": counts_ME,
            "expert_counts_by_source": counts_MSE, "router_entropy": entropy_M}


def expert_load_by_source(
    ids_BLk: jax.Array, mask_BL: jax.Array, source_B: jax.Array, num_sources: int, num_experts: int
) -> jax.Array:
    """Token copies each expert received from each data source over the unmasked tokens: int32 [S, E],
    row s counting the tokens of the batch rows with `source_B` = s.

    Counted like `moe.expert_load` (the mask as weights of a bincount, rounded to int32), over the cells
    source · E + expert, so its sum over sources is exactly `moe.expert_load` of the same inputs; summed
    over devices and microbatches by the step as the expert counts are."""
    valid = jnp.broadcast_to(mask_BL.astype(jnp.float32)[..., None], ids_BLk.shape)
    cell_BLk = source_B.astype(ids_BLk.dtype)[:, None, None] * num_experts + ids_BLk
    counts = jnp.bincount(cell_BLk.reshape(-1), weights=valid.reshape(-1), length=num_sources * num_experts)
    return jnp.round(counts).astype(jnp.int32).reshape(num_sources, num_experts)


def router_entropy(logits_BLE: jax.Array, mask_BL: jax.Array, router_kind: str) -> jax.Array:
    """Mean over real tokens of the entropy of each token's routing distribution (the softmax, or the
    sigmoid scores normalised to sum 1): log E when uniform, 0 when one expert takes everything."""
    scores = jax.lax.stop_gradient(moe.router_probs(logits_BLE, router_kind))
    probs = scores / jnp.maximum(scores.sum(-1, keepdims=True), 1e-30)
    per_token = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0), -1)
    return (per_token * mask_BL).sum() / jnp.maximum(mask_BL.sum(), 1.0)


def token_nll(
    params: Params, hidden_BLD: jax.Array, targets_BL: jax.Array, spec: ModelSpec, chunk: int = 0
) -> jax.Array:
    """Per-token negative log-likelihood [B, L] fp32 of the targets under the logits of `hidden_BLD`.

    With `chunk` (a divisor of L), the logits are made `chunk` positions at a time and recomputed in the
    backward pass, so at most [B, chunk, V] logits exist at once; the result equals the unchunked one.
    """
    B, L, D = hidden_BLD.shape
    if not chunk or chunk >= L:
        return cross_entropy(model_lib.unembed(params, hidden_BLD, spec), targets_BL)
    n = L // chunk
    # the output weight gathered once for all blocks (and its gradient summed whole, then split once),
    # rather than gathered and reduced again in every block
    head = "embed" if spec.tie_embeddings else "lm_head"
    whole = {head: sharding.constrain(params[head], ("vocab", "act_embed"))}

    @jax.checkpoint
    def block(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        hidden_BcCD, targets_BcC = args  # one chunk of each of the c devices' blocks
        rows, c = targets_BcC.shape[:2]
        logits = model_lib.unembed(whole, hidden_BcCD.reshape(rows, c * chunk, D), spec)
        return cross_entropy(logits, targets_BcC.reshape(rows, c * chunk)).reshape(rows, c, chunk)

    # a sequence split over c context devices holds n/c blocks on each: the blocks are walked as n/c
    # steps over [B, c, chunk] so each step reads every device's own block, never a gathered sequence
    c = sharding.context_degree()
    c = c if n % c == 0 else 1
    hidden_mBcCD = jnp.moveaxis(hidden_BLD.reshape(B, c, n // c, chunk, D), 2, 0)
    targets_mBcC = jnp.moveaxis(targets_BL.reshape(B, c, n // c, chunk), 2, 0)
    hidden_mBcCD = sharding.constrain(hidden_mBcCD, (None, "batch", "seq", None, None))
    nll_mBcC = jax.lax.map(block, (hidden_mBcCD, targets_mBcC))
    return jnp.moveaxis(nll_mBcC, 0, 2).reshape(B, L)


def loss_fn(
    params: Params,
    batch: Batch,
    *,
    spec: ModelSpec,
    cfg: model_lib.ModelConfig,
    loss: LossConfig,
    num_sources: int,
    step_tokens: jax.Array | None = None,
    values: StepValues | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(total loss, metrics): masked mean cross-entropy plus weighted router losses.

    `values` are the in-step techniques' traced values of this step (`FORWARD_VALUES`): a loss term's
    coefficient given there replaces the config's.

    `params` are as the forward reads them (`model.weights_for_compute`). When `batch` is one microbatch
    of a step, `step_tokens` is the step's count of real tokens: the cross-entropy is divided by it and
    the router losses weighted by this microbatch's share of it, so the losses and metrics of the
    microbatches add up to the step's (the cross-entropy and z-loss exactly those of one batch; the
    load-balancing loss a token-weighted mean of the microbatches' own).
    """
    hidden_BLD, aux = model_lib.hidden_states(params, batch["inputs"], spec, cfg, placement=sharding.PLACEMENT,
                                              token_index_BL=held_order(batch["inputs"].shape))
    mask_BL = batch["mask"].astype(jnp.float32)
    nll_BL = token_nll(params, hidden_BLD, batch["targets"], spec, loss.ce_chunk) * mask_BL
    tokens = mask_BL.sum()
    denominator = tokens if step_tokens is None else step_tokens
    share = tokens / jnp.maximum(denominator, 1.0)
    ce = nll_BL.sum() / jnp.maximum(denominator, 1.0)
    metrics = {
        "loss": ce,
        "tokens": tokens,
        "source_loss": jax.ops.segment_sum(nll_BL.sum(-1), batch["source_id"], num_sources),
        "source_tokens": jax.ops.segment_sum(mask_BL.sum(-1), batch["source_id"], num_sources),
    }
    total = ce
    if aux.router_logits is not None:
        terms = router_terms(aux, mask_BL, spec, batch["source_id"], num_sources)
        lb, z = share * terms["lb_loss"], share * terms["z_loss"]
        values = values or {}
        total = total + values.get("lb_coef", loss.lb_coef) * lb + values.get("z_coef", loss.z_coef) * z
        metrics.update(lb_loss=lb, z_loss=z, expert_counts=terms["expert_counts"],
                       expert_counts_by_source=terms["expert_counts_by_source"],
                       router_entropy=share * terms["router_entropy"])
    metrics["total_loss"] = total
    return total, metrics


def held_order(shape: tuple[int, ...]) -> jax.Array | None:
    """Each token's index in its sequence as the batch holds it ([B, L]): context parallelism's balanced
    order on a mesh that splits sequences (`global_batch` put them so), else None (sequence order)."""
    degree = sharding.context_degree()
    if degree == 1:
        return None
    return jnp.broadcast_to(jnp.asarray(context_parallel.balanced_order(shape[1], degree)), shape)


def make_train_step(
    spec: ModelSpec,
    cfg: model_lib.ModelConfig,
    loss: LossConfig,
    tx: optax.GradientTransformation,
    schedule: Schedule,
    num_sources: int,
    microbatches: int = 1,
    trainable: Params | None = None,
    techniques: Sequence[StepTechnique] = (),
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The (unjitted) step: gradients of `loss_fn`, clipped AdamW update, metrics of the step, with the
    in-step `techniques` (`upcycler.train.techniques.in_step`: the run's are `step_list.for_run`) handing
    the forward their values of the step and adjusting the state after the update, in order.

    With `microbatches` > 1 the rows run in that many parts under a `lax.scan`, gradients and metrics
    summed in fp32: the same update as one batch (see `loss_fn`), with one part's activations alive.
    `trainable` (from `optim.trainable_rows`) zeroes the frozen rows' gradients before the norm is taken.
    """

    def loss_of(weights: Params, batch: Batch, step_tokens: jax.Array | None, values: StepValues):
        return loss_fn(weights, batch, spec=spec, cfg=cfg, loss=loss, num_sources=num_sources,
                       step_tokens=step_tokens, values=values)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def gradients(state: TrainState, batch: Batch, values: StepValues) -> tuple[Params, dict[str, jax.Array]]:
        weights = model_lib.weights_for_compute(state.params, spec, cfg)  # once per step, before gathers
        if microbatches == 1:
            (_, metrics), grads = grad_fn(weights, batch, None, values)
        else:
            step_tokens = batch["mask"].astype(jnp.float32).sum()
            micro = split_microbatches(batch, microbatches)
            (_, metrics), grads = _accumulate(partial(grad_fn, values=values), weights, micro, step_tokens, spec)
        return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params), metrics

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        values = in_step.step_values(list(techniques), state.step, FORWARD_VALUES)
        grads, metrics = gradients(state, batch, values)
        grads = keep_trainable(grads, trainable)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics.update(grad_norm=grad_norm(grads, spec), lr=schedule(state.step))
        after = TrainState(state.step + 1, params, opt_state, state.ema)
        for technique in techniques:
            after = technique.after_update(state, after, metrics)
        return after, metrics

    return step


def split_microbatches(batch: Batch, microbatches: int) -> Batch:
    """Every array [B, ...] as [microbatches, B / microbatches, ...], microbatch j holding rows j, j + k,
    j + 2k, …: each device's block of rows splits into its own share of every microbatch, so no row moves
    between devices."""

    def split(x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
        x = jnp.swapaxes(x, 0, 1)
        return sharding.constrain(x, (None, "batch", "seq")[: x.ndim] + (None,) * (x.ndim - 3))

    return {k: split(v) for k, v in batch.items()}


def _accumulate(grad_fn, weights: Params, micro: Batch, step_tokens: jax.Array, spec: ModelSpec):
    """Sum over the microbatches of ((loss, metrics), gradients): floats in fp32, the gradient sums laid
    out like the parameters (never a whole replicated copy)."""

    def body(carry, microbatch):
        out = grad_fn(weights, microbatch, step_tokens)
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry, out), None

    first = jax.tree.map(lambda x: x[0], micro)
    (loss_shape, metric_shapes), grad_shapes = jax.eval_shape(lambda b: grad_fn(weights, b, step_tokens), first)
    zeros = jax.tree.map(_zeros_like_summed, (loss_shape, metric_shapes))
    grad_zeros = jax.tree.map(
        lambda info, g: sharding.constrain(jnp.zeros(g.shape, jnp.float32), info.axes),
        declare_tree(spec), grad_shapes, is_leaf=lambda x: isinstance(x, ParamInfo),
    )
    summed, _ = jax.lax.scan(body, (zeros, grad_zeros), micro)
    return summed


def _zeros_like_summed(s: jax.ShapeDtypeStruct) -> jax.Array:
    return jnp.zeros(s.shape, jnp.float32 if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype)


@dataclass(frozen=True)
class StateLayout:
    """Everything about the train state that follows from the spec, the optimiser options and the mesh:
    the optimiser, its schedule, the state's shardings and its abstract shapes (no memory)."""

    tx: optax.GradientTransformation
    schedule: Schedule
    shardings: TrainState
    abstract: TrainState
    trainable: Params | None  # `optim.trainable_rows`: None when every parameter trains


def state_layout(spec: ModelSpec, optimizer: OptimizerConfig, mesh: Mesh,
                 lineage: Sequence[Mapping[str, Any]] = ()) -> StateLayout:
    """The layout of the train state of `spec` on `mesh`: float32 master weights laid out by the
    sharding rules, Adam moments like their parameters (of the trainable rows only), counters replicated.
    `lineage` (the init checkpoint's) tells `optimizer.trainable: new_layers` which blocks are new."""
    tx, schedule = make_optimizer(optimizer, spec, lineage)
    param_shardings = sharding.param_shardings(spec, mesh)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=s), abstract_params(spec), param_shardings
    )
    opt_shardings = opt_state_shardings(tx, params, param_shardings, mesh)
    opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(tx.init, params), opt_shardings
    )
    replicated = sharding.replicated(mesh)
    with_ema = optimizer.ema > 0
    shardings = TrainState(replicated, param_shardings, opt_shardings, param_shardings if with_ema else None)
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params, opt_state,
                          params if with_ema else None)
    return StateLayout(tx, schedule, shardings, abstract, trainable_rows(optimizer, spec, lineage))


def abstract_batch(global_batch_size: int, seq_len: int, mesh: Mesh) -> Batch:
    """The shapes, dtypes and shardings of one global batch (as `upcycler.train.data.mix` makes it)."""
    shardings = batch_shardings(mesh)
    shapes = {"inputs": ((global_batch_size, seq_len), jnp.int32), "targets": ((global_batch_size, seq_len), jnp.int32),
              "mask": ((global_batch_size, seq_len), jnp.float32), "source_id": ((global_batch_size,), jnp.int32)}
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k]) for k, (shape, dtype) in shapes.items()}


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


def program_fingerprint(compiled: Any) -> str:
    """A digest of a compiled program's optimised HLO without what names where it came from (the module's
    name, the source files, functions and stack frames of its metadata, which follow the caller): equal
    digests, the same program."""
    text = re.sub(r"^HloModule \S+", "HloModule", compiled.as_text(), count=1, flags=re.MULTILINE)
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(\d+ .*\n)*", "", text, flags=re.MULTILINE)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def global_batch(local: dict[str, Any], mesh: Mesh) -> Batch:
    """This process's rows (numpy) as global arrays sharded over the mesh; with `mesh.context` > 1 each
    sequence in context parallelism's balanced order first (`held_order` tells the model)."""
    shardings, (_, blocks) = batch_shardings(mesh), data_shard(mesh)
    local = context_parallel.to_device_order({k: local[k] for k in BATCH_KEYS}, sharding.mesh_sizes(mesh)["context"])
    # every process's rows are one block of the batch; a sequence's chunks are looked up in the whole row
    return {k: jax.make_array_from_process_local_data(shardings[k], local[k],
                                                      (local[k].shape[0] * blocks, *local[k].shape[1:]))
            for k in BATCH_KEYS}
