"""Run a checkpoint on a small probe one layer at a time, so checking a model never needs all of it in memory.

`hidden_trace(ckpt, ids)` is the JAX model's forward pass (`transformer.one_layer`, the same code as the
trainer's) fed one layer's tensors at a time: the embedding rows of the probe, then each decoder layer
(loaded in its stored dtype, computed in fp32 at the highest matmul precision, then dropped), then the
final norm and the head. It yields the hidden states after every layer and finally the logits, so a
caller can walk two models in lockstep and say which layer first differs.

`reordered=True` runs the same function with the FFN neurons of every layer (and of every expert) in a
fixed shuffled order: the same function, a different fp32 summation order. Its distance to the plain run
is the model's own fp32 noise floor, the yardstick `upcycler.verify` judges differences with. Both runs
share one read of each layer.

`ffn_inputs(ckpt, ids)` walks the same way and yields, per layer, the normalised hidden state its FFN and
router read (what calibrating a router needs), a few sequences at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.layout import declare_layer, layer_prefix
from upcycler.spec import ModelSpec
from upcycler.train.config import ModelConfig
from upcycler.train.model import layers as nn
from upcycler.train.model.params import layer_kind
from upcycler.train.model.transformer import layer_windows, one_layer, one_layer_ffn_input

FP32 = ModelConfig(compute_dtype="float32")
# FFN parameters whose axis `neurons` is the intermediate (neuron) axis: reordered together
_NEURON_AXIS = {"mlp.gate_proj": 0, "mlp.up_proj": 0, "mlp.down_proj": 1, "mlp.gate_bias": 0, "mlp.up_bias": 0,
                "moe.experts.gate_proj": 1, "moe.experts.up_proj": 1, "moe.experts.down_proj": 2,
                "moe.shared.gate_proj": 0, "moe.shared.up_proj": 0, "moe.shared.down_proj": 1}
REORDER_SEED = 20250101


def hidden_trace(ckpt: Any, ids_BL: np.ndarray, *, reordered: bool = False) -> Iterator[list[np.ndarray]]:
    """Per layer, the residual stream after it ([B, L, D] fp32) for the plain run (and the reordered one);
    last, the logits [B, L, V] fp32 of each run. One layer's tensors are in memory at a time."""
    spec, tensors = ckpt.spec, ckpt.tensors
    embed = tensors["embed"].load()
    x = jnp.asarray(embed[ids_BL].astype(np.float32))
    runs = [x, x] if reordered else [x]
    windows = layer_windows(spec)
    with jax.default_matmul_precision("highest"):
        for i in range(spec.num_layers):
            params = layer_params(spec, tensors, i)
            variants = [params, _reorder(params, i)] if reordered else [params]
            kind, window = layer_kind(spec, i), windows[i]
            runs = [_apply(h, p, spec, kind, window) for h, p in zip(runs, variants)]
            del params, variants
            yield [np.asarray(h) for h in runs]
        head = embed if spec.tie_embeddings else tensors["lm_head"].load()
        del embed
        norm = jnp.asarray(tensors["final_norm"].load())
        yield [np.asarray(_logits(h, norm, jnp.asarray(head), spec)) for h in runs]


def ffn_inputs(ckpt: Any, ids_BL: np.ndarray, *, chunk: int = 16) -> Iterator[tuple[int, np.ndarray]]:
    """Per layer i, (i, the normalised input of its FFN and router [B, L, D] fp32), computed `chunk`
    sequences at a time (the residual stream of all B sequences is kept); one layer in memory at a time."""
    spec, tensors = ckpt.spec, ckpt.tensors
    x = tensors["embed"].load()[ids_BL].astype(np.float32)
    windows = layer_windows(spec)
    with jax.default_matmul_precision("highest"):
        for i in range(spec.num_layers):
            params = layer_params(spec, tensors, i)
            kind, window = layer_kind(spec, i), windows[i]
            h = np.empty_like(x)
            for lo in range(0, len(x), chunk):
                y, h_part = _apply_with_input(jnp.asarray(x[lo:lo + chunk]), params, spec, kind, window)
                x[lo:lo + chunk], h[lo:lo + chunk] = np.asarray(y), np.asarray(h_part)
            del params
            yield i, h


def logits_of(ckpt: Any, ids_BL: np.ndarray) -> np.ndarray:
    """fp32 logits [B, L, V] of a checkpoint on a probe, one layer in memory at a time."""
    last = None
    for last in hidden_trace(ckpt, ids_BL):
        pass
    assert last is not None
    return last[0]


@partial(jax.jit, static_argnames=("spec", "kind", "window"))
def _apply(x_BLD, p, spec: ModelSpec, kind: str, window: int):
    p = jax.tree.map(lambda w: w.astype(jnp.float32), p)
    return one_layer(x_BLD, p, spec, FP32, kind=kind, window=window)


@partial(jax.jit, static_argnames=("spec", "kind", "window"))
def _apply_with_input(x_BLD, p, spec: ModelSpec, kind: str, window: int):
    p = jax.tree.map(lambda w: w.astype(jnp.float32), p)
    return one_layer_ffn_input(x_BLD, p, spec, FP32, kind=kind, window=window)


@partial(jax.jit, static_argnames=("spec",))
def _logits(x_BLD, norm_D, head_VD, spec: ModelSpec):
    h = nn.rms_norm(x_BLD, norm_D.astype(jnp.float32), spec.rms_norm_eps)
    return jnp.einsum("bld,vd->blv", h, head_VD.astype(jnp.float32), preferred_element_type=jnp.float32)


def layer_params(spec: ModelSpec, tensors: Any, layer: int) -> dict:
    """Layer `layer`'s tensors as the nested dict `one_layer` takes, in their stored dtype."""
    prefix = layer_prefix(layer)
    tree: dict = {}
    for decl in declare_layer(spec, layer):
        node = tree
        *path, leaf = decl.name[len(prefix):].split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(tensors[decl.name].load())
    return tree


def _reorder(params: dict, layer: int) -> dict:
    """`params` with the FFN neurons in a shuffled order (a fixed permutation per layer and width)."""
    out = jax.tree.map(lambda w: w, params)
    for name, axis in _NEURON_AXIS.items():
        *path, leaf = name.split(".")
        node = out
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        w = node[leaf]
        order = np.random.default_rng([REORDER_SEED, layer, w.shape[axis]]).permutation(w.shape[axis])
        node[leaf] = jnp.take(w, order, axis=axis)
    return out
