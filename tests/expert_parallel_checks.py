"""Measurements of the expert-parallel MoE layer on 8 fake CPU devices, printed as one JSON object.

Run by `test_expert_parallel.py` in a child process (the device count must be set before JAX starts).
For each routing case and dispatch variant it runs the layer under a (data 1, fsdp 2, expert 4) mesh and
reports the relative error of the output and of every gradient against the one-device dropless layer.
It compiles some 60 small programs and runs each once, so it compiles for speed (`xla_flags.FAST_COMPILE`).
"""

from __future__ import annotations

import json
import os
import sys

from xla_flags import with_devices

os.environ["XLA_FLAGS"] = with_devices(8, fast_compile=True)  # 60 small compiles, each run once
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from upcycler.train.config import ModelConfig
from upcycler.train.loop import sharding
from upcycler.train.model import expert_parallel, moe

T, D, F, E = 64, 16, 24, 8
MESH = {"data": 1, "fsdp": 2, "expert": 4}


def routing_case(name: str, top_k: int, key) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] for a case: random, some experts never chosen, or every token to expert 5."""
    logits = jax.random.normal(key, (T, E))
    if name == "empty_experts":  # experts 0, 1 and 4..7 only: device 0 keeps one empty expert, device 1 gets none
        logits = logits + jnp.asarray([9, 9, -30, -30, 9, 9, 9, 9], jnp.float32)
    if name == "one_expert":
        logits = logits + 40.0 * jax.nn.one_hot(5, E)
    return logits


def layer_and_grads(cfg: ModelConfig, x, logits, w_gu, w_down, probe, top_k, transport="padded"):
    """The layer's output and the gradients of a probe loss. `transport` is static (a jit key): a transport
    set from outside the traced function would be ignored by a cached trace of the same config."""
    expert_parallel.default_transport = lambda: transport

    def loss(x, logits, w_gu, w_down):
        routing = moe.route(logits, top_k, "renormalized")
        y = expert_parallel.moe_layer(x, w_gu, w_down, routing, cfg, sharding.PLACEMENT)
        return jnp.sum(y.astype(jnp.float32) * probe), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, logits, w_gu, w_down)
    return y, grads


def place(mesh, arrays):
    axes = (expert_parallel.TOKEN_AXES, expert_parallel.TOKEN_AXES, *expert_parallel.WEIGHT_AXES, ("batch", None))
    return [jax.device_put(a, NamedSharding(mesh, sharding.logical_to_spec(ax, a.shape, mesh)))
            for a, ax in zip(arrays, axes)]


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> None:
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = jax.random.normal(k1, (T, D))
    w_gu = jax.random.normal(k2, (E, D, 2 * F)) / np.sqrt(D)
    w_down = jax.random.normal(k3, (E, D, F)) / np.sqrt(F)
    probe = jax.random.normal(k4, (T, D))
    mesh = sharding.make_mesh(**MESH)
    results = {}
    variants = {
        "all_to_all": ("all_to_all", "padded"),
        "all_to_all_ragged": ("all_to_all", "ragged_emulated"),
        "all_gather": ("all_gather", "padded"),
        "all_gather_chunked": ("all_gather", "chunked"),
        "gspmd": ("gspmd", "padded"),
    }
    for case, top_k in (("random", 2), ("random", 6), ("empty_experts", 2), ("one_expert", 3)):
        logits = routing_case(case, top_k, jax.random.PRNGKey(top_k))
        ref_y, ref_grads = jax.jit(layer_and_grads, static_argnums=(0, 6))(
            ModelConfig(), x, logits, w_gu, w_down, probe, top_k)
        load = np.bincount(np.asarray(moe.route(logits, top_k, "renormalized").expert_Tk).ravel(), minlength=E)
        for name, (dispatch, transport) in variants.items():
            for comm_dtype in ("fp32", "bf16", "fp8") if name != "gspmd" else ("fp32",):
                chunks = 4 if transport == "chunked" else 1  # 4 chunks of the 4 × 64 gathered tokens
                cfg = ModelConfig(moe_dispatch=dispatch, comm_dtype=comm_dtype, moe_chunks=chunks)
                with jax.set_mesh(mesh):
                    args = place(mesh, [x, logits, w_gu, w_down, probe])
                    y, grads = jax.jit(layer_and_grads, static_argnums=(0, 6, 7))(cfg, *args, top_k, transport)
                errors = {"y": relative(y, ref_y)}
                errors.update({f"d_{n}": relative(g, r) for n, g, r in
                               zip(("x", "logits", "w_gate_up", "w_down"), grads, ref_grads)})
                results[f"{case}/k{top_k}/{name}/{comm_dtype}"] = {**errors, "load": load.tolist()}
    logits = routing_case("random", 2, jax.random.PRNGKey(2))
    _, ref_grads = jax.jit(layer_and_grads, static_argnums=(0, 6))(ModelConfig(), x, logits, w_gu, w_down, probe, 2)
    for dispatch in ("gspmd", "all_to_all"):
        for grad_comm in ("fp32", "bf16"):
            cfg = ModelConfig(moe_dispatch=dispatch, grad_comm_dtype=grad_comm)
            with jax.set_mesh(mesh):
                args = place(mesh, [x, logits, w_gu, w_down, probe])
                _, grads = jax.jit(layer_and_grads, static_argnums=(0, 6))(cfg, *args, 2)
            results[f"grad_comm/{dispatch}/{grad_comm}"] = {
                f"d_{n}": relative(g, r) for n, g, r in zip(("w_gate_up", "w_down"), grads[2:], ref_grads[2:])}
    results["reductions"] = reduction_errors(mesh)
    json.dump(results, sys.stdout)


def reduction_errors(mesh) -> dict[str, float]:
    """Relative error of a reduce-scatter over 8 devices against float64, per way of running it: float32,
    bf16 all-to-all + float32 sum (`comm.reduce_scatter`), fp8 likewise, and a ring that adds in bf16 at
    every hop (what a low-precision reduce-scatter does)."""
    from jax.sharding import PartitionSpec as P

    from upcycler.train.model import comm

    n, rows = 8, 32
    parts = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (n, n * rows, 256)), np.float32)
    exact = parts.astype(np.float64).sum(axis=0).reshape(n * rows, 256)
    flat = jax.device_put(parts.reshape(n * n * rows, 256),
                          NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    axes = ("data", "fsdp", "expert")

    def ring_bf16(y):
        me = jax.lax.axis_index(axes)
        blocks = y.reshape(n, rows, -1).astype(jnp.bfloat16)
        acc = jnp.take(blocks, (me + 1) % n, axis=0)  # start with the block of the next device in the ring
        for hop in range(1, n):
            acc = jax.lax.ppermute(acc, axes, [(i, (i - 1) % n) for i in range(n)])
            acc = acc + jnp.take(blocks, (me + 1 + hop) % n, axis=0)
        return acc.astype(jnp.float32)

    ways = {
        "fp32": lambda y: comm.reduce_scatter_raw(y, axes, "fp32"),
        "bf16": lambda y: comm.reduce_scatter_raw(y, axes, "bf16"),
        "fp8": lambda y: comm.reduce_scatter_raw(y, axes, "fp8"),
        "bf16_ring": ring_bf16,
    }
    out = {}
    for name, way in ways.items():
        run = jax.jit(jax.shard_map(way, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
        out[name] = relative(run(flat), exact)
    return out


if __name__ == "__main__":
    main()
