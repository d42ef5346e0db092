"""Start JAX's multi-process runtime when configured, and build the (data, fsdp, context, expert) device mesh.

Every host runs the same command. `distributed.coordinator` (host:port) turns on `jax.distributed`; the
process count and this process's id come from the config, else from `JAX_NUM_PROCESSES` /
`JAX_PROCESS_ID`, else from JAX's cluster detection (SLURM, Cloud TPU, MPI), which is also what
`coordinator: auto` asks for. CPU processes exchange data over JAX's default CPU collectives (gloo).

The mesh spans every device of every process with `AxisType.Auto` axes (GSPMD-style FSDP); which array
dimension goes to which mesh axis is decided only by `upcycler.train.loop.sharding`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train.config import DistributedConfig, MeshConfig
from upcycler.train.loop import context_parallel, sharding

_initialised = False


def init_distributed(d: DistributedConfig) -> None:
    """Call `jax.distributed.initialize` once if `d` asks for several processes; before any other JAX call."""
    global _initialised
    if d.coordinator is None or _initialised:
        return
    num = d.num_processes if d.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = d.process_id if d.process_id is not None else _env_int("JAX_PROCESS_ID")
    address = None if d.coordinator == "auto" else d.coordinator
    try:
        jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                                   heartbeat_timeout_seconds=d.heartbeat_timeout)
    except (ValueError, TypeError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UpcyclerError(
            f"distributed start-up failed ({first}); set distributed.coordinator, num_processes and "
            "process_id (or JAX_NUM_PROCESSES / JAX_PROCESS_ID) identically on every host but the id"
        ) from None
    _initialised = True


def build_mesh(
    m: MeshConfig,
    global_batch_size: int,
    spec: ModelSpec | None = None,
    *,
    microbatches: int = 1,
    devices: Sequence[Any] | None = None,
    seq_len: int = 1,
    moe_chunks: int = 1,
    moe_dispatch: str = "gspmd",
) -> Mesh:
    """The mesh over all devices (or `devices`, e.g. a TPU slice to compile for); raises `UpcyclerError`
    if it does not fit the devices, the batch and its microbatches, the experts, the token chunks of
    the all_gather dispatch (`moe_chunks` must divide the tokens an `expert` group gathers), or leaves
    the all_to_all dispatch an expert axis of one device (`mesh.expert: -1` on what remains)."""
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    try:
        experts = spec.moe.num_experts if spec is not None and spec.moe is not None else 0
        mesh = sharding.make_mesh(m.data, m.fsdp, m.expert, devices=devices, experts=experts, context=m.context)
    except ValueError as err:
        raise UpcyclerError(
            f"mesh {m.data}×{m.fsdp}×{m.context}×{m.expert} (data×fsdp×context×expert) does not fit {count} "
            f"devices ({err}); make the sizes multiply to the device count or set one to -1"
        ) from None
    sizes = sharding.mesh_sizes(mesh)
    context_parallel.check_length(seq_len, sizes["context"])
    size = sizes["data"] * sizes["fsdp"] * sizes["expert"]  # the devices that split the rows
    if global_batch_size % (size * microbatches):
        raise UpcyclerError(
            f"data.global_batch_size {global_batch_size} is not divisible by the mesh's {size} devices "
            f"({sizes}) × data.microbatches {microbatches}; make it a multiple of {size * microbatches}"
        )
    per_process = global_batch_size // jax.process_count()
    row_devices = max(_local_count(devices) // sizes["context"], 1)  # a sequence's devices may span processes
    if per_process % row_devices:
        raise UpcyclerError(
            f"data.global_batch_size {global_batch_size} gives {per_process} rows per process, not divisible "
            f"by its {row_devices} row groups of devices; make it a multiple of {size}"
        )
    if spec is not None and spec.moe is not None and spec.moe.num_experts % mesh.shape["expert"]:
        raise UpcyclerError(
            f"{spec.moe.num_experts} experts do not split over mesh.expert = {mesh.shape['expert']}; "
            "pick an expert axis size that divides the expert count"
        )
    if moe_dispatch == "all_to_all" and spec is not None and spec.moe is not None and mesh.shape["expert"] == 1:
        raise UpcyclerError(
            f"model.moe_dispatch all_to_all sends tokens to the devices of mesh.expert, and mesh.expert "
            f"{m.expert} leaves it 1 of the {count} devices (nothing to exchange); give mesh.expert more "
            "devices (lower mesh.data or mesh.fsdp), or set model.moe_dispatch to gspmd"
        )
    gathered = global_batch_size // (microbatches * sizes["data"] * sizes["fsdp"]) * seq_len // sizes["context"]
    if moe_chunks > 1 and gathered % moe_chunks:
        raise UpcyclerError(
            f"model.moe_chunks {moe_chunks} does not divide the {gathered} tokens each expert group gathers "
            f"(global batch × seq_len / (microbatches × data × fsdp)); pick a divisor of {gathered}"
        )
    return mesh


def data_shard(mesh: Mesh) -> tuple[int, int]:
    """(index, count): this process reads block `index` of `count` equal blocks of every batch's rows, the
    rows its devices hold. Block `process_index` of `process_count` unless a sequence's context devices span
    processes: those processes then read the same block (their devices take different chunks of it)."""
    sizes = sharding.mesh_sizes(mesh)
    rows = math.prod(sizes[axis] for axis in ("data", "fsdp", "expert"))
    shape = (rows, sizes["context"])  # one row per row group, one token per context device
    held = sorted({index[0].indices(rows)[0]
                   for index in sharding.batch_sharding(mesh).addressable_devices_indices_map(shape).values()})
    if len(held) * jax.process_count() == rows:
        return jax.process_index(), jax.process_count()
    if held != list(range(held[0], held[0] + len(held))) or rows % len(held):
        raise UpcyclerError(f"{describe(mesh)}: this process's devices hold rows {held[:8]} of each {rows}, not "
                            "one contiguous block; give mesh.context a size whose devices lie on whole hosts")
    return held[0] // len(held), rows // len(held)


def _local_count(devices: Sequence[Any]) -> int:
    """This process's share of `devices` (all of them for devices no process owns: a slice to compile for)."""
    local = sum(1 for d in devices if getattr(d, "process_index", 0) == jax.process_index())
    return local or len(devices)


def describe(mesh: Mesh) -> str:
    """One line: the mesh shape and the process layout."""
    shape = " × ".join(f"{k}={v}" for k, v in mesh.shape.items())
    devices = f"{jax.device_count()} {jax.devices()[0].platform} devices"
    return f"mesh {shape} over {devices} in {jax.process_count()} processes"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UpcyclerError(f"environment variable {name}={value!r} is not an integer") from None
