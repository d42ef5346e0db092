"""The routed experts of an MoE layer across devices: who holds which experts, and how tokens reach them.

`moe_layer` is what the transformer calls. Every device runs the layer on its own block of tokens inside
`jax.shard_map` (so the sort and the grouped matmul cover only its token copies), and
`ModelConfig.moe_dispatch` decides where the experts are:

- `gspmd` (the default, and the reference): every device all-gathers every expert's weights (FSDP over
  all mesh axes) and runs the plain dropless layer of `moe.dropless_moe` on its tokens.
- `all_to_all`: the `expert` mesh axis of n devices splits the E experts, L = E/n per device (their
  model width still all-gathered over `fsdp`). Each device sorts its T·k token copies by expert, sends
  each run of copies to the device holding that expert, runs its L experts on what it received, and sends
  the results back, where they are combined with the routing weights in float32. On TPU and GPU the two
  exchanges are `lax.ragged_all_to_all` (only the rows that exist travel). XLA:CPU does not implement it
  (jax-ml/jax#34755), so on CPU each device sends n fixed blocks of T·min(k, L) rows (a padded
  `lax.all_to_all`): the same results, n·T·min(k, L) rows of buffer per device.
- `all_gather` (MegaScale-MoE's choice when k is above n; MaxText's ring of experts): tokens and their
  routing are all-gathered over the `expert` axis, each device runs its L experts on the copies routed to
  them and sums them per token, and a reduce-scatter returns every token's sum to its device.

Dropless in every variant: no capacity, no token dropped. Buffers are sized for the worst case, every
copy of n·T tokens landing on one device's experts: n·T·min(k, L) rows (a token's k experts are distinct,
so at most min(k, L) of its copies go to one device).

`ModelConfig.comm_dtype` compresses the collectives that carry the combine and its gradients
(`upcycler.train.model.comm`): the all_to_all variant's return trip and both trips' backward, the
all_gather variant's reduce-scatter and the backward of its token gather. Tokens travel to the experts in
the compute dtype. Routing (router, top-k, load-balancing statistics) is computed before the layer on
the whole batch, so the losses and the expert load are the same for every variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from upcycler.train.config import ModelConfig
from upcycler.train.model import comm, moe
from upcycler.train.model.gmm import gmm, target_platform
from upcycler.train.model.placement import ONE_DEVICE, Placement

TOKEN_AXES = ("tokens", "act_embed")  # [T, D]: the batch rows' tokens, flattened (rows, then sequence chunks)
ROUTING_AXES = ("tokens", None)
WEIGHT_AXES = (("experts", "expert_embed", "expert_mlp"),) * 2  # [E, D, 2F] and down as stored, [E, D, F]
Transport = Literal["padded", "ragged", "ragged_emulated"]


def moe_layer(
    x_TD: jax.Array,
    w_gate_up_EDU: jax.Array,
    w_down_EDF: jax.Array,
    routing: moe.Routing,
    cfg: ModelConfig,
    placement: Placement = ONE_DEVICE,
) -> jax.Array:
    """The routed experts' output y_TD for `cfg.moe_dispatch` (see the module docstring).

    `placement` (from whoever built the mesh) gives the mesh, how each argument is laid out on it, the
    `expert` axis and the per-device runner. Without a mesh, or on a mesh of one device, every dispatch
    is the one-device dropless layer.
    """
    mesh = placement.mesh()
    args = (x_TD, routing.expert_Tk, routing.weight_Tk, w_gate_up_EDU, w_down_EDF)
    axes = (TOKEN_AXES, ROUTING_AXES, ROUTING_AXES, *WEIGHT_AXES)
    gathered = (False, False, False, True, True)
    backend = cfg.gmm_backend
    if cfg.moe_dispatch == "gspmd" or mesh is None or mesh.size == 1:

        def layer(x_TD, expert_Tk, weight_Tk, w_gate_up_EDU, w_down_EDF):
            routing = moe.Routing(expert_Tk, weight_Tk)
            return moe.dropless_moe(x_TD, w_gate_up_EDU, w_down_EDF, routing, backend=backend)

        return placement.per_device(layer, args, axes, gathered, grad_comm=cfg.grad_comm_dtype)

    _check_expert_layout(placement, mesh, x_TD, w_gate_up_EDU)
    if cfg.moe_dispatch == "all_to_all":
        variant = partial(all_to_all_moe, transport=default_transport())
    elif cfg.moe_dispatch == "all_gather":
        variant = partial(all_gather_moe, chunks=cfg.moe_chunks)
    else:
        raise ValueError(f"moe_dispatch must be gspmd, all_to_all or all_gather, not {cfg.moe_dispatch!r}")

    axis = placement.expert_axis

    def local(x_TD, expert_Tk, weight_Tk, w_gate_up_LDU, w_down_LDF):
        routing = moe.Routing(expert_Tk, weight_Tk)
        return variant(x_TD, w_gate_up_LDU, w_down_LDF, routing, axis=axis, comm_dtype=cfg.comm_dtype,
                       backend=backend).astype(x_TD.dtype)

    return placement.per_device(local, args, axes, gathered, keep_local=(axis,), grad_comm=cfg.grad_comm_dtype)


PADDED_DEVICE_KINDS = ("TPU v5 lite",)  # libtpu: "Ragged all-to-all is currently not supported in limited
                                       # ICI routing settings" (v5e); v4, v5p and v6e compile it


def default_transport() -> Transport:
    """`lax.ragged_all_to_all` where XLA implements it (GPU; TPU v4, v5p, v6e), else the padded all-to-all
    (CPU, TPU v5e). Decided by the mesh being compiled for, as `gmm.target_platform` is."""
    if target_platform() == "cpu":
        return "padded"
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return "padded" if getattr(device, "device_kind", None) in PADDED_DEVICE_KINDS else "ragged"


def _check_expert_layout(placement: Placement, mesh, x_TD: jax.Array, w_gate_up_EDU: jax.Array) -> None:
    axis = placement.expert_axis
    size = mesh.shape[axis]
    if size == 1:
        return
    token_spec = placement.spec(TOKEN_AXES, x_TD.shape, mesh)
    expert_spec = placement.spec(WEIGHT_AXES[0], w_gate_up_EDU.shape, mesh)
    token_axes = token_spec[0] if token_spec and isinstance(token_spec[0], tuple) else token_spec[:1]
    experts_over = expert_spec[0] if expert_spec and isinstance(expert_spec[0], tuple) else expert_spec[:1]
    if axis not in token_axes or not experts_over or experts_over[0] != axis:
        raise ValueError(
            f"expert-parallel dispatch needs the {x_TD.shape[0]} tokens and the {w_gate_up_EDU.shape[0]} "
            f"experts split over mesh axis {axis!r} of size {size}; make the batch a multiple of the "
            "device count and the expert count a multiple of that axis"
        )


# ------------------------------------------------------------------------------------- the local experts


def _experts(x_XD, w_gate_up_LDU, w_down_LDF, group_sizes_L, backend) -> jax.Array:
    """Rows grouped by local expert through gate/up, SwiGLU and down; rows past the groups give 0."""
    h_XU = gmm(x_XD, w_gate_up_LDU, group_sizes_L, backend=backend)
    return gmm(moe.swiglu(h_XU), w_down_LDF, group_sizes_L, backend=backend, transpose_rhs=True)


def worst_case_rows(tokens: int, top_k: int, local_experts: int) -> int:
    """Most copies of `tokens` tokens that can go to one device's `local_experts` (distinct experts per
    token): the dropless buffer size per source device."""
    return tokens * min(top_k, local_experts)


# ------------------------------------------------------------------------------------------- all_gather


def all_gather_moe(
    x_TD: jax.Array,
    w_gate_up_LDU: jax.Array,
    w_down_LDF: jax.Array,
    routing: moe.Routing,
    *,
    axis: str,
    comm_dtype: comm.CommDtype = "fp32",
    backend: str = "auto",
    chunks: int = 1,
) -> jax.Array:
    """This device's tokens' y_TD (float32), its L experts being block `axis_index(axis)` of the E.

    All-gather the n·T tokens and their routing; keep the copies routed here; grouped matmuls; the fp32
    sum per token over the local experts; `comm.reduce_scatter` sums the n devices' partial outputs and
    returns each its own tokens. With `chunks` > 1 (dividing n·T) the gathered tokens go through the
    experts a chunk at a time (`lax.map`), each chunk recomputed in the backward pass, so the dropless
    buffers hold n·T/chunks tokens' copies. Inside `shard_map` over `axis`.
    """
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    num_local = w_gate_up_LDU.shape[0]
    t, top_k = routing.expert_Tk.shape
    x_all = comm.all_gather(x_TD, axis, comm_dtype)
    expert_all = lax.all_gather(routing.expert_Tk, axis, axis=0, tiled=True)
    weight_all = lax.all_gather(routing.weight_Tk, axis, axis=0, tiled=True)
    local_all = expert_all - me * num_local

    def through_local_experts(x_TD, local_Tk, weight_Tk):
        here = (local_Tk >= 0) & (local_Tk < num_local)
        plan = moe.plan_dispatch(jnp.where(here, local_Tk, num_local), num_local + 1)  # the rest sorts last
        rows = worst_case_rows(x_TD.shape[0], top_k, num_local)
        copy_X = plan.copy_X[:rows]
        pos_Tk = jnp.where(here, plan.pos_C.reshape(-1, top_k), rows)  # copies elsewhere: no row here
        x_XD = moe.dispatch_rows(x_TD, copy_X, pos_Tk)
        y_XD = _experts(x_XD, w_gate_up_LDU, w_down_LDF, plan.group_sizes_E[:num_local], backend)
        return moe.combine_rows(y_XD, weight_Tk, pos_Tk, copy_X)

    if chunks == 1:
        partial_TD = through_local_experts(x_all, local_all, weight_all)
    else:
        if (n * t) % chunks:
            raise ValueError(f"model.moe_chunks {chunks} does not divide the {n * t} gathered tokens")
        split = [a.reshape(chunks, n * t // chunks, *a.shape[1:]) for a in (x_all, local_all, weight_all)]
        body = jax.checkpoint(lambda args: through_local_experts(*args), prevent_cse=False)
        partial_TD = lax.map(body, tuple(split)).reshape(n * t, -1)
    return comm.reduce_scatter(partial_TD, axis, comm_dtype, comm_dtype)


# ------------------------------------------------------------------------------------------- all_to_all


class Route(NamedTuple):
    """Where the expert-sorted copies of each device go on the `expert` axis, from this device's side.

    [n] int32 each, indexed by the other device: the rows this device sends it (`send_start`, `send_counts`
    in its sorted buffer; `out_offsets`, where they land in the receiver's packed buffer), the rows it
    receives from it (`recv_start`, `recv_counts` in its own packed buffer; `back_offsets`, where the sender
    keeps them). `expert_R` [R] is the local expert of each received row (L for an empty row).
    """

    send_start: jax.Array
    send_counts: jax.Array
    out_offsets: jax.Array
    recv_start: jax.Array
    recv_counts: jax.Array
    back_offsets: jax.Array
    expert_R: jax.Array


@dataclass(frozen=True)
class Exchange:
    """The static side of a `Route`: the mesh axis, the transport, slots per peer, sorted copies C."""

    axis: str
    transport: Transport
    slots: int
    copies: int


def all_to_all_moe(
    x_TD: jax.Array,
    w_gate_up_LDU: jax.Array,
    w_down_LDF: jax.Array,
    routing: moe.Routing,
    *,
    axis: str,
    comm_dtype: comm.CommDtype = "fp32",
    backend: str = "auto",
    transport: Transport = "padded",
) -> jax.Array:
    """This device's tokens' y_TD (float32), its L experts being block `axis_index(axis)` of the E.

    Sort the T·k copies by expert (hence by the device holding it), send them, regroup what arrived by
    local expert, grouped matmuls, send the results back (payload `comm_dtype`), combine in float32.
    Inside `shard_map` over `axis`.
    """
    n = lax.axis_size(axis)
    num_local = w_gate_up_LDU.shape[0]
    t, top_k = routing.expert_Tk.shape
    plan = moe.plan_dispatch(routing.expert_Tk, n * num_local)
    pos_Tk = plan.pos_C.reshape(t, top_k)
    x_XD = moe.dispatch_rows(x_TD, plan.copy_X, pos_Tk)
    exchange = Exchange(axis, transport, worst_case_rows(t, top_k, num_local), t * top_k)
    route = plan_route(plan.group_sizes_E, exchange)
    x_RD = send(x_XD, route, exchange, True, None, comm_dtype)
    y_RD = _received_rows_through_experts(x_RD, route.expert_R, w_gate_up_LDU, w_down_LDF, backend)
    y_XD = send(y_RD, route, exchange, False, comm_dtype, comm_dtype)
    return moe.combine_rows(y_XD, routing.weight_Tk, pos_Tk, plan.copy_X)


def _received_rows_through_experts(x_RD, expert_R, w_gate_up_LDU, w_down_LDF, backend) -> jax.Array:
    """Each received row through its local expert, back in the received order (empty rows give 0)."""
    num_local = w_gate_up_LDU.shape[0]
    plan = moe.plan_dispatch(expert_R[:, None], num_local + 1)
    pos_R1 = plan.pos_C[:, None]
    x_XD = moe.dispatch_rows(x_RD, plan.copy_X, pos_R1)
    y_XD = _experts(x_XD, w_gate_up_LDU, w_down_LDF, plan.group_sizes_E[:num_local], backend)
    unit_R1 = jnp.ones(pos_R1.shape, jnp.float32)
    return moe.combine_rows(y_XD, unit_R1, pos_R1, plan.copy_X).astype(x_RD.dtype)  # exact: one term each


def plan_route(group_sizes_E: jax.Array, exchange: Exchange) -> Route:
    """The `Route` of this device's copies, from every device's per-expert counts (one small all-gather)."""
    axis = exchange.axis
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    num_local = group_sizes_E.shape[0] // n
    counts_nnL = lax.all_gather(group_sizes_E.astype(jnp.int32), axis).reshape(n, n, num_local)
    sent_nn = jnp.sum(counts_nnL, axis=-1)  # [source, destination]: rows the source sends
    send_counts, recv_counts = sent_nn[me], sent_nn[:, me]
    ahead_nn = jnp.cumsum(sent_nn, axis=1) - sent_nn  # source's buffer offset of its rows for each dest
    landed_nn = jnp.cumsum(sent_nn, axis=0) - sent_nn  # dest's packed offset of each source's rows
    recv_start = landed_nn[:, me]
    base = recv_start if exchange.transport != "padded" else jnp.arange(n, dtype=jnp.int32) * exchange.slots
    expert_R = _local_expert_of_rows(counts_nnL[:, me, :], base, n * exchange.slots)
    return Route(ahead_nn[me], send_counts, landed_nn[me], recv_start, recv_counts, ahead_nn[:, me], expert_R)


def _local_expert_of_rows(counts_nL: jax.Array, base_n: jax.Array, rows: int) -> jax.Array:
    """The local expert of each received row: source s's rows start at `base_n[s]`, `counts_nL[s, l]`
    of them for expert l in order; rows outside every run get L."""
    num_local = counts_nL.shape[1]
    ends_nL = base_n[:, None] + jnp.cumsum(counts_nL, axis=1)
    starts_nL = ends_nL - counts_nL
    row_R = jnp.arange(rows, dtype=jnp.int32)
    run_R = jnp.searchsorted(starts_nL.reshape(-1), row_R, side="right").astype(jnp.int32) - 1
    run_R = jnp.clip(run_R, 0, counts_nL.size - 1)
    inside = (row_R >= starts_nL.reshape(-1)[run_R]) & (row_R < ends_nL.reshape(-1)[run_R])
    return jnp.where(inside, run_R % num_local, num_local).astype(jnp.int32)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def send(rows, route: Route, exchange: Exchange, toward_experts: bool, payload, grad):
    """Move rows along `route`: sorted copies to the experts' devices (`toward_experts`) or back.

    `payload` None sends the rows as they are and returns them in their dtype; a `comm` payload encodes
    them and returns float32. The backward pass is the move the other way with the `grad` payload.
    """
    return _send(rows, route, exchange, toward_experts, payload)


def _send(rows, route, exchange, toward_experts, payload):
    if payload is None:
        return _move(rows, route, exchange, toward_experts)
    return comm.decode(_move(comm.encode(rows, payload), route, exchange, toward_experts), payload)


def _send_fwd(rows, route, exchange, toward_experts, payload, grad):
    return _send(rows, route, exchange, toward_experts, payload), (route, jnp.zeros((0,), rows.dtype))


def _send_bwd(exchange, toward_experts, payload, grad, residuals, g):
    route, dtype_witness = residuals
    if grad == "fp32":  # the cotangent of rows widened to float32 is sent in the rows' own dtype: the
        g = g.astype(dtype_witness.dtype)  # gradient is cast to it on arrival anyway
    back = _send(g, route, exchange, not toward_experts, grad)
    return back.astype(dtype_witness.dtype), None


send.defvjp(_send_fwd, _send_bwd)


def _move(rows, route: Route, ex: Exchange, toward_experts: bool) -> jax.Array:
    """The raw exchange: sender's sorted [C, W] rows to the receiver's [n·slots, W] buffer, or back."""
    n = lax.axis_size(ex.axis)
    received = n * ex.slots
    if ex.transport == "padded":
        if toward_experts:
            blocks = moe.take_rows(rows, _copy_of_slots(route, ex)).reshape(n, ex.slots, -1)
            return lax.all_to_all(blocks, ex.axis, 0, 0).reshape(received, -1)
        blocks = lax.all_to_all(rows.reshape(n, ex.slots, -1), ex.axis, 0, 0).reshape(received, -1)
        return moe.take_rows(blocks, _slot_of_copies(route, ex))
    ragged = lax.ragged_all_to_all if ex.transport == "ragged" else ragged_all_to_all_emulated
    if toward_experts:
        out = jnp.zeros((received, rows.shape[1]), rows.dtype)
        return ragged(rows, out, route.send_start, route.send_counts, route.out_offsets, route.recv_counts,
                      axis_name=ex.axis)
    out = jnp.zeros((ex.copies, rows.shape[1]), rows.dtype)
    return ragged(rows, out, route.recv_start, route.recv_counts, route.back_offsets, route.send_counts,
                  axis_name=ex.axis)


def _copy_of_slots(route: Route, ex: Exchange) -> jax.Array:
    """Padded transport: the sorted copy in slot s of the block for device j (C, out of range, if none)."""
    slot = jnp.arange(ex.slots, dtype=jnp.int32)[None, :]
    copy = route.send_start[:, None] + slot
    return jnp.where(slot < route.send_counts[:, None], copy, ex.copies).reshape(-1)


def _slot_of_copies(route: Route, ex: Exchange) -> jax.Array:
    """Padded transport: the slot each sorted copy was sent in (block of its device, then its rank)."""
    copy = jnp.arange(ex.copies, dtype=jnp.int32)
    ends = route.send_start + route.send_counts
    dest = jnp.searchsorted(ends, copy, side="right").astype(jnp.int32)
    dest = jnp.minimum(dest, route.send_start.shape[0] - 1)
    return dest * ex.slots + copy - route.send_start[dest]


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`lax.ragged_all_to_all`'s documented semantics from an all-gather, for platforms without it (tests
    of the ragged route on CPU): row r of the result is sender i's operand row
    `input_offsets_i[me] + r - output_offsets_i[me]` when r falls in sender i's slice, else `output[r]`."""
    del recv_sizes  # implied by the senders' sizes
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    operands = lax.all_gather(operand, axis_name)
    starts, sizes, lands = (lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets))
    row = jnp.arange(output.shape[0], dtype=jnp.int32)
    result = output
    for i in range(n):
        inside = (row >= lands[i]) & (row < lands[i] + sizes[i])
        values = moe.take_rows(operands[i], starts[i] + row - lands[i])
        result = jnp.where(inside[:, None], values, result)
    return result
