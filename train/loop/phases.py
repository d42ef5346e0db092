"""Data phases of their own length on the loop: every shape checked before the run, one compile per shape.

A data phase may set its own `seq_len` and `global_batch_size` (`upcycler.train.data.config.Phase`), as
Llama 3 and ProLong lengthen the context in stages. What the loop needs of that lives here:

- `check_shapes` refuses, before a run directory exists, a shape the mesh cannot split (the same checks
  as the section's own shape, `mesh.build_mesh`), and a phase length beyond the model's
  `max_position_embeddings` when the checkpoint has no RoPE scaling (`upcycle context` extends it);
- `at_longest` is the config `--compile-only` and `--plan` compile: the phase of the longest rows (the
  largest batch among equally long ones), where a row's attention and activations peak;
- `CompiledSteps` compiles the train step once per batch shape and keeps it, so a phased run compiles
  once per distinct shape whatever the number of steps, and a run resumed after a boundary compiles
  only the shapes it still meets. The step's function, its shardings and the learning-rate schedule (in
  steps) are the same for every shape: only the batch's shape differs, so the trajectory is the one an
  uninterrupted run follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train.config import TrainConfig
from upcycler.train.data.config import DataConfig
from upcycler.train.loop import train_step
from upcycler.train.reporting.flops import flops_per_token
from upcycler.train.reporting.goodput import RunClock
from upcycler.untrusted import shown_path


def check_shapes(config: TrainConfig, spec: ModelSpec, devices: Sequence[Any] | None = None) -> None:
    """Raise `UpcyclerError` (one line) unless every phase's shape fits the mesh over `devices` (default:
    all) and every phase length fits the model's positions; the section's own shape is the mesh's."""
    from upcycler.train.loop import mesh as mesh_lib

    data = config.data
    check_lengths(config, spec)
    checked = {(data.seq_len, data.global_batch_size)}
    for k, (seq_len, batch) in enumerate(data.shapes):
        if (seq_len, batch) in checked:
            continue
        checked.add((seq_len, batch))
        try:
            mesh_lib.build_mesh(config.mesh, batch, spec, microbatches=data.microbatches, devices=devices,
                                seq_len=seq_len, moe_chunks=config.model.moe_chunks,
                                moe_dispatch=config.model.moe_dispatch)
        except UpcyclerError as err:
            raise UpcyclerError(f"data.phases[{k}] ({batch} rows of {seq_len} tokens): {err}") from None


def check_lengths(config: TrainConfig, spec: ModelSpec) -> None:
    """`data.seq_len` and every phase's own within `max_position_embeddings`, unless the checkpoint's RoPE
    is scaled (then the scaling decides how far positions reach)."""
    if spec.rope_scaling is not None:
        return
    if config.data.seq_len > spec.max_position_embeddings:
        raise UpcyclerError(
            f"{shown_path(config.model.init)}: data.seq_len {config.data.seq_len:,} is beyond the model's "
            f"max_position_embeddings {spec.max_position_embeddings:,} and its RoPE is not scaled; run "
            "`upcycle context` on the checkpoint first (or lower data.seq_len)"
        )
    for k, phase in enumerate(config.data.phases):
        if phase.seq_len is not None and phase.seq_len > spec.max_position_embeddings:
            raise UpcyclerError(
                f"{shown_path(config.model.init)}: data.phases[{k}].seq_len {phase.seq_len:,} is beyond the "
                f"model's max_position_embeddings {spec.max_position_embeddings:,} and its RoPE is not scaled; "
                f"run `upcycle context` on the checkpoint first (or lower the phase's seq_len)"
            )


def at_longest(config: TrainConfig) -> TrainConfig:
    """`config` with the data section's shape set to its longest phase's (`DataConfig.longest_shape`) and
    the phases' own shapes dropped: one step to compile. Everything else is kept (the weights, the
    schedule, every other section); a config without phases of their own length is returned as it is."""
    data = config.data
    if not data.phased:
        return config
    seq_len, batch = data.longest_shape()
    plain = tuple(replace(p, seq_len=None, global_batch_size=None, batch="rows") for p in data.phases)
    return replace(config, data=replace(data, seq_len=seq_len, global_batch_size=batch, phases=plain))


class CompiledSteps:
    """The train step compiled for each batch shape met, kept for the rest of the run.

    `compile(state, batch, clock)` compiles the run's step (`run_build.BuiltRun`) for `batch`'s shape only
    the first time that shape is met, `for_batch(batch)` returns it; `compiles` counts the compilations and
    `fingerprints` names each program compiled (`train_step.program_fingerprint`), in order."""

    def __init__(self, built: Any):
        self.built = built
        self._compiled: dict[tuple[int, ...], Any] = {}
        self.compiles = 0
        self.fingerprints: list[str] = []

    def has(self, batch: dict[str, Any]) -> bool:
        """Whether the step for `batch`'s shape is compiled already."""
        return _shape(batch) in self._compiled

    def compile(self, state: Any, batch: dict[str, Any], clock: RunClock | None = None) -> int:
        """Compile the step for `batch`'s shape unless it is compiled already (timed as the `clock`'s
        program start-up); returns how many shapes are compiled when this one was new, else 0."""
        if self.has(batch):
            return 0
        with clock.timed("program_startup") if clock is not None else nullcontext():
            self._compiled[_shape(batch)] = compiled = self.built.compile(state, batch)
        self.fingerprints.append(train_step.program_fingerprint(compiled))
        self.compiles += 1
        return self.compiles

    def for_batch(self, batch: dict[str, Any]) -> Any:
        """The step compiled for `batch`'s shape (`compile` first)."""
        return self._compiled[_shape(batch)]


def step_size(spec: ModelSpec, data: DataConfig, step: int) -> tuple[int, float]:
    """(tokens, model FLOPs) of the global batch of `step`, at its phase's shape."""
    seq_len, rows = data.shape_at(step)
    return rows * seq_len, flops_per_token(spec, seq_len) * rows * seq_len


def _shape(batch: dict[str, Any]) -> tuple[int, ...]:
    """(rows, seq_len) of a batch."""
    return tuple(batch["inputs"].shape)
