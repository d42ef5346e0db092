"""Context parallelism on 8 fake CPU devices against one device, printed as one JSON object.

Run by `test_context_parallel.py` in a child process (the device count must be set before JAX starts).
Each case computes the train step's loss and gradients (`train_step.loss_fn`) of one batch twice: on one
device in sequence order, and on a mesh that splits every sequence over `context` devices, the batch put
there by `train_step.global_batch` (context parallelism's balanced order). It reports the losses, the
largest relative error over every gradient, and whether the integer statistics are equal. The packed
case runs the model alone with segment ids and positions that restart per document, as packed data does.
"""

from __future__ import annotations

import json
import os
import sys

from xla_flags import with_devices

os.environ["XLA_FLAGS"] = with_devices(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
from trainer_fixtures import tiny_spec

from upcycler.train.config import LossConfig, ModelConfig
from upcycler.train.loop import context_parallel, sharding
from upcycler.train.loop.train_step import global_batch, loss_fn
from upcycler.train.model import hidden_states
from upcycler.train.model.params import init_params

WINDOWED = {"sliding_window": 5, "layer_types": ("sliding_attention", "full_attention")}
CASES = {  # name: (spec changes, model options, mesh, batch rows, sequence length)
    "dense": ({}, {}, {"fsdp": 2, "context": 4}, 4, 64),
    "dense_sliding_window": (WINDOWED, {}, {"fsdp": 2, "context": 4}, 4, 64),
    "dense_dot_product": ({}, {"attention": "dot_product"}, {"fsdp": 2, "context": 4}, 4, 64),
    "moe_dropless": ({"moe": True}, {}, {"fsdp": 2, "context": 4}, 4, 64),
    "moe_expert_parallel": ({"moe": True}, {"moe_dispatch": "all_to_all"}, {"fsdp": 1, "context": 4, "expert": 2},
                            4, 64),
    # the splash kernel (interpreted): the smallest length whose 2 × 2 chunks are one 128-token tile each
    "splash_sliding_window": ({"sliding_window": 100, "layer_types": ("sliding_attention", "full_attention")},
                              {"attention": "splash"}, {"fsdp": 4, "context": 2}, 4, 512),
    # the ring exchange: four devices, so a block makes three hops and the pairs take every mask kind
    # (skipped, whole, causal, windows offset by one and two chunks)
    "splash_ring_sliding_window": ({"sliding_window": 200, "layer_types": ("sliding_attention", "full_attention")},
                                   {"attention": "splash", "context_exchange": "ring"}, {"fsdp": 2, "context": 4},
                                   2, 1024),
}


def batch_of(spec, rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.integers(0, spec.vocab_size, (rows, length)).astype(np.int32),
            "targets": rng.integers(0, spec.vocab_size, (rows, length)).astype(np.int32),
            "mask": (rng.random((rows, length)) > 0.1).astype(np.float32),
            "source_id": rng.integers(0, 2, rows).astype(np.int32)}


def train_case(spec_changes, options, mesh_sizes, rows, length) -> dict:
    moe = spec_changes.pop("moe", False)
    spec, cfg = tiny_spec(moe=moe, **spec_changes), ModelConfig(**options)
    params = init_params(spec, jax.random.key(0), std=0.05)
    local = batch_of(spec, rows, length)
    grad_fn = jax.jit(jax.value_and_grad(
        lambda p, b: loss_fn(p, b, spec=spec, cfg=cfg, loss=LossConfig(), num_sources=2), has_aux=True))
    (loss_one, metrics_one), grads_one = grad_fn(params, {k: jnp.asarray(v) for k, v in local.items()})
    mesh = sharding.make_mesh(**mesh_sizes, experts=spec.moe.num_experts if spec.moe else 0)
    with jax.set_mesh(mesh):
        batch = global_batch(local, mesh)
        (loss_mesh, metrics_mesh), grads_mesh = grad_fn(jax.device_put(params, sharding.param_shardings(spec, mesh)),
                                                        batch)
    errors = [float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(a)), 1e-30))
              for a, b in zip(jax.tree.leaves(grads_one), jax.tree.leaves(grads_mesh))]
    integer = {k: bool(np.array_equal(np.asarray(metrics_one[k]), np.asarray(metrics_mesh[k])))
               for k in ("expert_counts", "expert_counts_by_source") if k in metrics_one}
    floats = {k: [float(metrics_one[k]), float(metrics_mesh[k])] for k in ("loss", "lb_loss", "z_loss", "tokens")
              if k in metrics_one}
    return {"loss": [float(loss_one), float(loss_mesh)], "grad_rel_error": max(errors), "grads": len(errors),
            "integer_equal": integer, "metrics": floats, "mesh": dict(mesh.shape),
            "input_spec": [a if isinstance(a, str) else list(a or ()) for a in batch["inputs"].sharding.spec]}


def packed_case(cfg: ModelConfig = ModelConfig(), length: int = 64, split: int = 40) -> dict:
    """Two documents per row, positions restarting at each: the hidden states on a context-4 mesh (tokens
    in the balanced order) put back in sequence order, against one device."""
    spec = tiny_spec(**WINDOWED)
    params = init_params(spec, jax.random.key(1), std=0.05)
    rows = 2
    ids = batch_of(spec, rows, length, seed=3)["inputs"]
    segments = np.where(np.arange(length) < split, 1, 2)[None].repeat(rows, 0).astype(np.int32)
    positions = np.where(np.arange(length) < split, np.arange(length), np.arange(length) - split)[None]
    positions = positions.repeat(rows, 0).astype(np.int32)
    run = jax.jit(lambda p, i, s, q, t: hidden_states(p, i, spec, cfg, segment_ids_BL=s, positions_BL=q,
                                                      token_index_BL=t, placement=sharding.PLACEMENT)[0])
    one = run(params, ids, segments, positions, None)
    degree = 4
    mesh = sharding.make_mesh(fsdp=2, context=degree)
    held = context_parallel.to_device_order(
        {"ids": ids, "segments": segments, "positions": positions,
         "index": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))}, degree)
    token_sharding = sharding.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        args = [jax.device_put(held[k], token_sharding) for k in ("ids", "segments", "positions", "index")]
        split_out = run(jax.device_put(params, sharding.param_shardings(spec, mesh)), *args)
    back = context_parallel.from_device_order(np.asarray(split_out), degree)
    # and the same tokens in sequence order would differ: the documents really are kept apart
    unsegmented = run(params, ids, None, positions, None)
    scale = float(np.abs(np.asarray(one)).max())
    return {"rel_error": float(np.abs(back - np.asarray(one)).max()) / scale,
            "second_document_differs_without_segments": float(np.abs(np.asarray(unsegmented) - np.asarray(one))
                                                              [:, split:].max()) / scale}


def main() -> None:
    only = set(sys.argv[1:])
    out = {name: train_case(dict(changes), options, mesh, rows, length)
           for name, (changes, options, mesh, rows, length) in CASES.items() if not only or name in only}
    if not only or "packed" in only:
        out["packed"] = packed_case()
    if not only or "packed_splash_ring" in only:  # a document boundary inside a chunk, three hops of the ring
        out["packed_splash_ring"] = packed_case(ModelConfig(attention="splash", context_exchange="ring"), 1024, 600)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
