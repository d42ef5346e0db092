"""The model's parameter pytree, derived from `upcycler.layout`, and its 1:1 map to canonical tensor names.

Layers of one kind (dense MLP or MoE) are stacked on a leading `layers` axis so the model can `scan` them:

    {"embed": [V, D], "final_norm": [D], "lm_head": [V, D] (untied only),
     "layers": {"dense": {"attn_norm": [Ld, D], "attn": {"q_proj": [Ld, H·h, D], …}, "mlp": {…}},
                "moe":   {"attn_norm": [Lm, D], …, "moe": {"router": [Lm, E, D], "experts": {…}, …}}}}

The leaf at `layers.<kind>.<suffix>` holds canonical tensors `layers.{i}.<suffix>` for the layers `i` of that
kind, in order; everything else is named as in the layout. Weights keep the canonical `[out, in]`
orientation, so an HF or Orbax checkpoint goes into the tree and comes back out byte for byte. Each leaf is
declared once (`declare_tree`) with its shape, logical axes and the canonical names it holds; shardings
(`upcycler.train.loop.sharding`), initialisation and loading are all derived from that declaration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.tensors import LazyTensor, TensorMap

Params = dict[str, Any]
KINDS: tuple[str, ...] = ("dense", "moe")


@dataclass(frozen=True)
class ParamInfo:
    """One leaf of the parameter tree: shape, logical axes, and the canonical names it holds (in order)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    names: tuple[str, ...]
    is_buffer: bool = False  # as declared (`upcycler.layout`): not trained, kept in float32
    computed_in_fp32: bool = False  # as declared: read in float32 by the forward whatever `weights_dtype`

    @property
    def stacked(self) -> bool:
        return bool(self.axes) and self.axes[0] == "layers"


@dataclass(frozen=True)
class LayerSpan:
    """Consecutive layers of one kind: they are `scan`ned together from `start` in their kind's stack."""

    kind: str
    start: int
    length: int


def layer_kind(spec: ModelSpec, layer: int) -> str:
    return "moe" if spec.is_moe_layer(layer) else "dense"


def layer_spans(spec: ModelSpec) -> tuple[LayerSpan, ...]:
    """The layers in order, grouped into spans of one kind (dense first layers, then MoE: two spans)."""
    spans: list[LayerSpan] = []
    seen = {k: 0 for k in KINDS}
    for i in range(spec.num_layers):
        kind = layer_kind(spec, i)
        if spans and spans[-1].kind == kind:
            spans[-1] = LayerSpan(kind, spans[-1].start, spans[-1].length + 1)
        else:
            spans.append(LayerSpan(kind, seen[kind], 1))
        seen[kind] += 1
    return tuple(spans)


def layers_of_kind(spec: ModelSpec, kind: str) -> tuple[int, ...]:
    return tuple(i for i in range(spec.num_layers) if layer_kind(spec, i) == kind)


@cache
def declare_tree(spec: ModelSpec) -> Params:
    """The parameter tree of `spec` with a `ParamInfo` at every leaf."""
    tree: Params = {}
    stacks: dict[tuple[str, str], list] = {}
    for decl in declare_params(spec):
        if decl.name.startswith("layers."):
            _, layer, suffix = decl.name.split(".", 2)
            stacks.setdefault((layer_kind(spec, int(layer)), suffix), []).append(decl)
        else:
            _insert(tree, (decl.name,), ParamInfo(decl.shape, decl.axes, (decl.name,), decl.is_buffer,
                                                  decl.computed_in_fp32))
    for (kind, suffix), decls in stacks.items():
        first = decls[0]
        if any(d.shape != first.shape or d.axes != first.axes for d in decls):
            raise ValueError(f"layers of kind {kind} disagree on the shape of {suffix}")
        if len(decls) != len(layers_of_kind(spec, kind)):
            raise ValueError(f"{suffix} is missing from some {kind} layers")
        info = ParamInfo((len(decls), *first.shape), ("layers", *first.axes), tuple(d.name for d in decls),
                         first.is_buffer, first.computed_in_fp32)
        _insert(tree, ("layers", kind, *suffix.split(".")), info)
    return tree


def _insert(tree: Params, path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _is_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)


def _infos(spec: ModelSpec) -> list[ParamInfo]:
    return jax.tree.leaves(declare_tree(spec), is_leaf=_is_info)


def _map(fn, spec: ModelSpec) -> Params:
    return jax.tree.map(fn, declare_tree(spec), is_leaf=_is_info)


def param_axes(spec: ModelSpec) -> Params:
    """The logical axes of every leaf (a tree of tuples of axis names)."""
    return _map(lambda info: info.axes, spec)


def abstract_params(spec: ModelSpec, dtype: Any = jnp.float32) -> Params:
    """`jax.ShapeDtypeStruct` leaves: the tree without any memory (for `jax.eval_shape`, Orbax restore)."""
    return _map(lambda info: jax.ShapeDtypeStruct(info.shape, _leaf_dtype(info, dtype)), spec)


def _leaf_dtype(info: ParamInfo, dtype: Any) -> Any:
    return jnp.float32 if info.is_buffer else dtype


# --- initialisation --------------------------------------------------------------------------------------
def _kind(info: ParamInfo) -> str:
    """How a leaf starts: "ones" (norms), "zeros" (biases, the router's selection bias) or "normal"."""
    if info.axes[-1] == "norm":
        return "ones"
    if info.names[0].rsplit(".", 1)[-1].endswith("_bias"):
        return "zeros"
    return "normal"


def init_params(
    spec: ModelSpec, key: jax.Array, dtype: Any = jnp.float32, std: float | None = None
) -> Params:
    """Random parameters: normal(0, std) matrices, unit norms, zero biases. Leaves follow `declare_tree`.

    `std` defaults to the checkpoint's `initializer_range` (0.02 when absent). One compiled computation;
    wrap it in `jax.jit(..., out_shardings=sharding.param_shardings(spec, mesh))` to create it sharded.
    """
    std = float(spec.extras_dict.get("initializer_range", 0.02)) if std is None else float(std)
    return _init(key, spec, jnp.dtype(dtype), std)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _init(key: jax.Array, spec: ModelSpec, dtype: Any, std: float) -> Params:
    # One normal draw for all matrices, cut into leaves: XLA compiles one RNG instead of one per leaf.
    infos = _infos(spec)
    random = [i for i in infos if _kind(i) == "normal"]
    sizes = [int(np.prod(i.shape)) for i in random]
    draws = std * jax.random.normal(key, (sum(sizes),), jnp.float32)
    offsets = dict(zip(random, np.cumsum([0, *sizes[:-1]]).tolist()))
    leaves = []
    for info, size in zip(infos, (int(np.prod(i.shape)) for i in infos)):
        leaf_dtype = _leaf_dtype(info, dtype)
        if _kind(info) == "normal":
            start = offsets[info]
            leaves.append(draws[start : start + size].reshape(info.shape).astype(leaf_dtype))
        else:
            leaves.append(jnp.full(info.shape, 1.0 if _kind(info) == "ones" else 0.0, leaf_dtype))
    return jax.tree.unflatten(jax.tree.structure(declare_tree(spec), is_leaf=_is_info), leaves)


# --- canonical tensors <-> tree ---------------------------------------------------------------------------
def from_tensors(
    spec: ModelSpec, tensors: TensorMap, *, dtype: Any = None, shardings: Params | None = None
) -> Params:
    """The parameter tree of a checkpoint's tensors (every canonical name used exactly once).

    Tensors keep their dtype unless `dtype` is given. With `shardings` (a tree of `NamedSharding`, e.g.
    `sharding.param_shardings`), each device's block is read on its own — a host never holds more than
    its shards plus one layer's tensor — through `jax.make_array_from_callback`.
    """
    expected = {n for info in _infos(spec) for n in info.names}
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise ValueError(f"tensors do not match the spec: missing {missing[:5]}, unexpected {extra[:5]}")

    def leaf(info: ParamInfo, sharding: Any = None) -> jax.Array:
        parts = [tensors[n] for n in info.names]
        for name, t in zip(info.names, parts):
            want = info.shape[1:] if info.stacked else info.shape
            if tuple(t.shape) != tuple(want):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the spec says {tuple(want)}")
        out_dtype = np.dtype(dtype) if dtype is not None else parts[0].dtype
        if sharding is None:
            return jnp.asarray(_block(parts, info, (), out_dtype))
        return jax.make_array_from_callback(
            info.shape, sharding, lambda index: _block(parts, info, index, out_dtype)
        )

    if shardings is None:
        return jax.tree.map(leaf, declare_tree(spec), is_leaf=_is_info)
    return jax.tree.map(leaf, declare_tree(spec), shardings, is_leaf=_is_info)


def _block(parts: list[LazyTensor], info: ParamInfo, index: tuple, dtype: np.dtype) -> np.ndarray:
    """`stack(parts)[index]` (or `parts[0][index]`), loading only the layers and experts it covers."""
    experts = info.axes[1 if info.stacked else 0] == "experts"
    if not info.stacked:
        return _slice(parts[0], index, experts).astype(dtype)
    layers = index[0] if index else slice(None)
    return np.stack(
        [_slice(parts[i], tuple(index[1:]), experts).astype(dtype) for i in range(len(parts))[layers]]
    )


def _slice(t: LazyTensor, index: tuple, experts: bool) -> np.ndarray:
    if experts and index and isinstance(index[0], slice):
        lead = range(t.shape[0])[index[0]]
        if len(lead) < t.shape[0]:  # a block of experts: read only those
            return np.stack([t.part(i) for i in lead])[(slice(None), *index[1:])]
    return t.load()[index]


def to_tensors(spec: ModelSpec, params: Params) -> TensorMap:
    """The canonical TensorMap of a parameter tree, lazily, in `declare_params` order.

    Each stacked leaf yields one tensor per layer; `part(e)` of an expert tensor fetches one expert.
    Arrays must be addressable from this process (gather multi-host arrays first).
    """
    out: dict[str, LazyTensor] = {}

    def add(info: ParamInfo, arr: jax.Array) -> None:
        if tuple(arr.shape) != info.shape:
            raise ValueError(f"{info.names[0]}: array shape {tuple(arr.shape)}, declared {info.shape}")
        for i, name in enumerate(info.names):
            out[name] = _lazy(
                arr, i if info.stacked else None, info.shape[1:] if info.stacked else info.shape
            )

    jax.tree.map(add, declare_tree(spec), params, is_leaf=_is_info)
    order = [d.name for d in declare_params(spec)]
    return TensorMap({name: out[name] for name in order})


def _lazy(arr: jax.Array, layer: int | None, shape: tuple[int, ...]) -> LazyTensor:
    dtype = np.dtype(arr.dtype)

    def load() -> np.ndarray:
        return np.asarray(arr if layer is None else arr[layer])

    def part(e: int) -> np.ndarray:
        return np.asarray(arr[e] if layer is None else arr[layer, e])

    return LazyTensor(tuple(shape), dtype, load, part)


def load_params(path: Any, *, dtype: Any = None, shardings_for: Any = None) -> tuple[ModelSpec, Params]:
    """(spec, params) of an HF or Orbax checkpoint directory (`upcycler.io.checkpoint.read_checkpoint`).

    `shardings_for(spec)` may return the shardings to place the parameters with (see `from_tensors`).
    """
    from upcycler.io import read_checkpoint

    ckpt = read_checkpoint(path)
    shardings = shardings_for(ckpt.spec) if shardings_for is not None else None
    return ckpt.spec, from_tensors(ckpt.spec, ckpt.tensors, dtype=dtype, shardings=shardings)
