"""The one place that knows the mesh: logical axis names → mesh axes, and the shardings derived from them.

Every parameter carries logical axes (`upcycler.layout`, plus `layers` for the stacked layer axis of
`upcycler.train.model.params`); activations are named with the `batch`/`seq`/`act_*` axes below. `RULES` maps
each logical axis to the mesh axes it is split over, and everything else — parameter shardings, batch
shardings, constraints inside the model — is derived from it. The mesh has four axes:

    data     pure data parallelism (parameters replicated)
    fsdp     data parallelism with parameters, gradients and optimiser state split (ZeRO-3)
    context  context parallelism: every sequence split along its length (`seq`), attention's keys and
             values gathered whole (`kv_seq`; `upcycler.train.loop.context_parallel` orders the chunks);
             parameters are split over it as over `fsdp`
    expert   expert parallelism: routed experts split over it; outside the experts it carries batch

and for an MoE with fewer experts per expert group than FSDP devices (64 experts over 256 chips) a fourth,
`fsdp_outer`: the FSDP devices as an outer × inner grid (`fsdp_outer` × `fsdp`, the same devices in the
same order), the outer part as large as the experts allow. Every FSDP-split dimension spans both, as one
`fsdp` axis would; the expert weights ([E, D, U] for gate and up, the down weight as stored, [E, D, F],
which the grouped matmul reads transposed) split E over the outer part and D over the inner one, so each
device holds one contiguous block of the E·D rows and FSDP's all-gather of them lands in the layout the
grouped matmul reads, with no relayout copy after it (`comm.gather_dims`).

A dimension that does not divide evenly over its mesh axes is replicated instead, so a tiny test model
runs on any mesh. A mesh axis may appear only once in one array's sharding.

The model itself knows none of this: it declares logical axes and asks a `Placement`
(`upcycler.train.model.placement`) where they live. `PLACEMENT` is this module's answer, passed to the
model by the train step (and by anyone who runs the model on a mesh of these axes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from upcycler.spec import ModelSpec
from upcycler.train.model import comm
from upcycler.train.model.params import ParamInfo, Params, declare_tree

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "context", "expert")  # every mesh has these
FSDP_OUTER = "fsdp_outer"  # the outer part of FSDP, present when the expert weights want it (see above)
MeshAxes = str | tuple[str, ...] | None

RULES: dict[str, MeshAxes] = {  # an axis the mesh does not have (`fsdp_outer`) is left out
    # parameters (axis names from upcycler.layout)
    "vocab": None,
    "embed": (FSDP_OUTER, "fsdp", "context"),
    "q_heads": None,
    "kv_heads": None,
    "mlp": None,
    "experts": ("expert", FSDP_OUTER),
    "expert_mlp": None,
    "expert_embed": ("fsdp", "context"),  # the model width of expert weights in kernel layout ([E, D, 2F], down as stored [E, D, F])
    "norm": None,
    "layers": None,
    # activations
    "batch": ("data", FSDP_OUTER, "fsdp", "expert"),
    "seq": "context",  # a sequence's tokens, split into chunks over the context devices
    "kv_seq": None,  # the keys and values attention reads: the whole sequence on every context device
    "tokens": ("data", FSDP_OUTER, "fsdp", "expert", "context"),  # [B·L] flattened: rows, then their chunks
    "act_embed": None,
    "act_vocab": None,
}


def make_mesh(data: int = 1, fsdp: int = -1, expert: int = 1, devices: Sequence[Any] | None = None,
              experts: int = 0, context: int = 1) -> Mesh:
    """A (data, fsdp, context, expert) mesh over `devices` (all by default); one size may be -1 (the rest).

    Over several slices a `data` of 1 with another axis at -1 (a one-slice layout, the default) becomes the
    slice count: data parallelism across slices, the -1 axis over each slice's devices. With `experts` (an
    MoE's routed expert count) whose share per expert group is below the FSDP size, FSDP is split into
    `fsdp_outer` × `fsdp` (`fsdp_split`), the same devices in the same order."""
    devices = list(jax.devices() if devices is None else devices)
    if data == 1 and -1 in (fsdp, context, expert):
        data = len({getattr(d, "slice_index", 0) for d in devices})
    sizes = [data, fsdp, context, expert]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not split into mesh axes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, have {len(devices)}"
        )
    grid = device_grid(sizes, devices)
    outer = fsdp_split(experts // sizes[3] if experts and experts % sizes[3] == 0 else 0, sizes[1])
    if outer == 1:
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    axes = ("data", FSDP_OUTER, "fsdp", "context", "expert")
    grid = grid.reshape(sizes[0], outer, sizes[1] // outer, *sizes[2:])
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def fsdp_split(local_experts: int, fsdp: int) -> int:
    """The outer FSDP size for `local_experts` per expert group over `fsdp` devices: the largest that
    divides both, when that leaves an inner part (fewer experts than FSDP devices); else 1, no split."""
    outer = math.gcd(local_experts, fsdp) if local_experts else 1
    return outer if 1 < outer < fsdp else 1


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """The mesh as configured: data, fsdp (its outer and inner parts together) and expert sizes."""
    return {"data": mesh.shape["data"], "fsdp": mesh.shape["fsdp"] * dict(mesh.shape).get(FSDP_OUTER, 1),
            "context": mesh.shape["context"], "expert": mesh.shape["expert"]}


def device_grid(sizes: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
    """`devices` laid out as a (data, fsdp, context, expert) grid of `sizes` that follows the hardware: on TPU,
    neighbours along each axis are neighbours on the ICI torus (`mesh_utils.create_device_mesh`); over
    several slices (multislice), the `data` axis is split into an outer part across slices, over the
    data-center network, and an inner part within each slice (`create_hybrid_device_mesh`), so only the
    data-parallel gradient reduction crosses slices. Other devices (CPU, GPU) keep their order. Raises
    `ValueError` when `data` is not a multiple of the slice count."""
    from jax.experimental import mesh_utils

    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        if sizes[0] % slices:
            raise ValueError(f"mesh.data {sizes[0]} must be a multiple of the {slices} slices (data parallelism "
                             "spans them)")
        return mesh_utils.create_hybrid_device_mesh([sizes[0] // slices, *sizes[1:]],
                                                     [slices, *(1,) * (len(sizes) - 1)], devices,
                                                     allow_split_physical_axes=True)
    if devices[0].platform != "tpu":
        return np.asarray(devices, dtype=object).reshape(sizes)
    try:
        return mesh_utils.create_device_mesh(list(sizes), devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        return np.asarray(devices, dtype=object).reshape(sizes)  # a shape the torus cannot hold as such


def _axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes]))


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    rules: dict[str, MeshAxes] | None = None,
) -> PartitionSpec:
    """The PartitionSpec for one array with logical `axes`.

    With `shape` and `mesh`, a dimension that does not divide by its mesh axes' size is replicated, and
    mesh axes of size 1 (or absent: `fsdp_outer`) are dropped. `fsdp_outer` goes to the first dimension
    that asks for it (the experts, in an expert weight), later ones keep `fsdp`. Raises if another mesh axis
    would split two dimensions.
    """
    rules = RULES if rules is None else rules
    out: list[MeshAxes] = []
    used: set[str] = set()
    for i, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; add it to RULES")
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        if mesh is None or FSDP_OUTER in used:  # the experts took the outer part: the width keeps the inner
            mesh_axes = tuple(a for a in mesh_axes if a != FSDP_OUTER)
        if mesh is not None:
            mesh_axes = tuple(a for a in mesh_axes if dict(mesh.shape).get(a, 1) > 1)
            if shape is not None and mesh_axes and shape[i] % _axis_size(mesh, mesh_axes):
                mesh_axes = ()
        clash = used.intersection(mesh_axes)
        if clash:
            raise ValueError(
                f"mesh axis {sorted(clash)} would split two dimensions of an array with axes {tuple(axes)}"
            )
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def param_shardings(spec: ModelSpec, mesh: Mesh) -> Params:
    """NamedShardings for the parameter tree of `spec` (same structure as `params.declare_tree(spec)`)."""
    return jax.tree.map(
        lambda info: NamedSharding(mesh, logical_to_spec(info.axes, info.shape, mesh)),
        declare_tree(spec),
        is_leaf=lambda x: isinstance(x, ParamInfo),
    )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a `[B, L, ...]` batch array: rows split over data × fsdp × expert, the length `L` (when
    `ndim` ≥ 2) over context."""
    return NamedSharding(mesh, logical_to_spec(("batch", "seq")[:ndim] + (None,) * (ndim - 2), mesh=mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Constrain an activation to its logical axes when a mesh is active (`jax.set_mesh`), else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def active_mesh() -> Any | None:
    """The mesh set by `jax.set_mesh` when it has our axes (an abstract mesh inside jit), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def context_degree() -> int:
    """How many devices split each sequence on the active mesh (`context`; 1 without a mesh)."""
    mesh = active_mesh()
    return 1 if mesh is None else dict(mesh.shape).get("context", 1)


def per_device(
    fn: Callable[..., jax.Array],
    args: Sequence[jax.Array],
    axes: Sequence[Sequence[str | None]],
    gathered: Sequence[bool],
    *,
    keep_local: Sequence[str] = (),
    grad_comm: str = "native",
) -> jax.Array:
    """`fn(*args)` run by every device on its own block of the arguments (`jax.shard_map`).

    Each argument is laid out by its logical `axes`. Arguments marked `gathered` are all-gathered inside
    over every mesh axis but those in `keep_local` (their gradient leaves as a reduce-scatter, FSDP's,
    sent as `grad_comm` says: see `comm.gather_dims`); the others stay local, so `fn` must compute each
    row of its output from the same rows of those arguments, or exchange rows itself over a `keep_local`
    axis. The output is laid out like the first argument. Without an active mesh, or when nothing is
    split, it is `fn(*args)`.
    """
    mesh = active_mesh()
    if mesh is None:
        return fn(*args)
    specs = [logical_to_spec(a_axes, a.shape, mesh) for a, a_axes in zip(args, axes)]
    if all(spec == PartitionSpec() for spec in specs) and not keep_local:
        return fn(*args)

    def local(*blocks: jax.Array) -> jax.Array:
        whole = [
            comm.gather_dims(b, _split_dims(spec, keep_local), grad_comm) if g else b
            for b, spec, g in zip(blocks, specs, gathered)
        ]
        return fn(*whole)

    # check_vma off: Pallas kernels (the TPU grouped matmul) carry no varying-axes types
    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=specs[0], check_vma=False)
    return run(*args)


def _split_dims(spec: PartitionSpec, keep_local: Sequence[str]) -> dict[int, str | tuple[str, ...]]:
    """Dimension -> the mesh axes it is split over in `spec`, leaving out the `keep_local` axes."""
    dims = {}
    for dim, mesh_axes in enumerate(spec):
        names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        names = tuple(a for a in names if a not in keep_local)
        if names:
            dims[dim] = names[0] if len(names) == 1 else names
    return dims


@dataclass(frozen=True)
class MeshPlacement:
    """The model placed by `RULES` on the mesh set with `jax.set_mesh` (a `model.placement.Placement`).

    Holds no mesh: the one active when the model is traced is used, so the same placement serves every
    mesh with the axes `MESH_AXES` and is a hashable static argument of the jitted model."""

    expert_axis: str = "expert"

    def mesh(self) -> Any | None:
        return active_mesh()

    def spec(self, axes: Sequence[str | None], shape: Sequence[int], mesh: Any) -> PartitionSpec:
        return logical_to_spec(axes, shape, mesh)

    def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        return constrain(x, axes)

    def per_device(self, fn, args, axes, gathered, *, keep_local=(), grad_comm="native") -> jax.Array:
        return per_device(fn, args, axes, gathered, keep_local=keep_local, grad_comm=grad_comm)


PLACEMENT = MeshPlacement(expert_axis="expert")
