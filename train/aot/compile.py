"""Compile the train step a run would use, without running it: for the local devices or a TPU slice.

`compile_only(config, topology=...)` builds the train state from the checkpoint's `ModelSpec` alone (a
directory holding only config.json is enough: no tensor is read, no data file opened), lays it out on the
configured mesh over the target devices, lowers and compiles the very step `upcycler.train.loop.trainer` runs
(the same `run_build.build`: mesh, shardings, remat, dtypes, microbatches), and returns the `compile_report.Report` of
what one device needs. A step too large for the target's memory fails the TPU compile with
RESOURCE_EXHAUSTED; that is reported as "does not fit" with the analytic part of the memory, not raised.
When data phases train at lengths of their own, every phase's shape is checked as the run checks it and
the step of the longest phase is compiled and reported (`upcycler.train.loop.phases.at_longest`): the
one whose rows need the most memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upcycler import hardware
from upcycler.errors import UpcyclerError
from upcycler.io import detect_format, read_checkpoint
from upcycler.io.hf_read import read_spec
from upcycler.spec import ModelSpec
from upcycler.train.aot import compile_report
from upcycler.train.aot.topology import parse_slice, tpu_devices
from upcycler.train.config import TrainConfig


@dataclass(frozen=True)
class Target:
    """The devices to compile for, how to name them, and the figures of one of them (None: unknown)."""

    devices: list[Any]
    name: str
    chip: hardware.Chip | None


def target(topology: str | None, slices: int = 1) -> Target:
    """A TPU slice by name (`v5e-256`), `slices` of them joined by the data-center network, or the devices
    this process sees when `topology` is None."""
    import jax

    if topology is None:
        devices = list(jax.devices())
        return Target(devices, f"local {devices[0].platform}", hardware.for_devices(devices))
    slice_ = parse_slice(topology)
    devices = tpu_devices(slice_, slices)
    return Target(devices, slice_.name if slices == 1 else f"{slices} × {slice_.name}", hardware.for_devices(devices))


def model_spec(path: Path) -> ModelSpec:
    """The architecture of the checkpoint at `path` (HF or Orbax); an HF directory may hold only config.json."""
    if detect_format(path) == "hf":
        return read_spec(path)
    return read_checkpoint(path).spec


def compile_only(config: TrainConfig, *, topology: str | None = None, hbm_budget: int | None = None,
                 slices: int = 1, save_bandwidth: float | None = None,
                 spec: ModelSpec | None = None) -> compile_report.Report:
    """Compile the train step of `config` for `topology` (None: the local devices) and report per device;
    `spec` stands for model.init's architecture (a shape not written yet: the upcycling advisor's).

    `hbm_budget` replaces the chip's usable HBM as the memory a device has (the only budget there is for
    a device the chip table does not know, such as a CPU). `save_bandwidth` (bytes/s one host writes to
    the bucket; default `save_time.DEFAULT_HOST_BANDWIDTH`) sets the checkpoint save's bound."""
    import jax

    from upcycler.train.loop import phases, run_build
    from upcycler.train.loop.train_step import abstract_batch

    spec = spec if spec is not None else model_spec(config.model.init)
    tgt = target(topology, slices)
    built = run_build.build(config, spec, devices=tgt.devices, lineage=_lineage(config.model.init))
    mesh, layout = built.mesh, built.layout
    config = phases.at_longest(config)
    batch = abstract_batch(config.data.global_batch_size, config.data.seq_len, mesh)
    started = time.perf_counter()
    try:
        with nullcontext() if topology is None else without_persistent_cache():
            compiled = built.compile(layout.abstract, batch)
        failure = None
    except jax.errors.JaxRuntimeError as err:  # how XLA refuses a program: out of memory, or unsupported
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise UpcyclerError(f"{tgt.name}: the compiler refused the step ({_first_line(str(err))}); "
                                "change the model options or the mesh") from None
        compiled, failure = None, _first_line(str(err), "RESOURCE_EXHAUSTED")
    seconds = time.perf_counter() - started
    budget = hbm_budget if hbm_budget is not None else (tgt.chip.hbm_budget_bytes if tgt.chip else None)
    return compile_report.build(
        config, spec, mesh, layout, batch, compiled,
        target_name=tgt.name, chip=tgt.chip, budget=budget, compile_seconds=seconds, failure=failure,
        **({} if save_bandwidth is None else {"save_bandwidth": save_bandwidth}),
    )


@contextmanager
def without_persistent_cache() -> Iterator[None]:
    """Keep JAX's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`, common on pods) out of a
    compile for chips this host does not have: such an executable is written to the cache but cannot be
    loaded back without a client of those chips, so the next compile-only run would warn and recompile.
    The cache is as it was afterwards."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used: decide again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def _lineage(init: Path) -> tuple[dict[str, Any], ...]:
    """The init checkpoint's lineage when it has a manifest (`optimizer.trainable: new_layers` reads it)."""
    from upcycler.io.manifest import MANIFEST, read_manifest

    return read_manifest(init).lineage if (init / MANIFEST).is_file() else ()


def _first_line(message: str, marker: str = "") -> str:
    """The compiler's line containing `marker` (else its first line), shortened for one error line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    chosen = next((line for line in lines if marker and marker in line), lines[0] if lines else "no message")
    return chosen[:400]

