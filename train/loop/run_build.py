"""The one place a run's step is assembled: the mesh, the train state's layout and the train step.

The trainer (`upcycler.train.loop.trainer`), the compile-only path (`upcycler.train.aot.compile`, and through
it the planner and the shape advisor) and the benchmarks (`bench/train_step.py`) all take their step from
`build`, so "compile-only compiles the step training runs" holds by construction: the same mesh over the
same devices, the same layout (shardings, optimiser, trainable rows), the same step function with the
same in-step techniques (`upcycler.train.techniques.step_list.for_run`), compiled by
the same `train_step.compile_step` (whose `program_fingerprint` names a compiled program by its optimised
HLO: how a test shows the two paths compile one program).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

from upcycler.spec import ModelSpec
from upcycler.train.config import TrainConfig
from upcycler.train.loop import mesh as mesh_lib
from upcycler.train.loop import train_step
from upcycler.train.loop.preflight import check_spec_options
from upcycler.train.techniques import step_list


@dataclass(frozen=True)
class BuiltRun:
    """A run's mesh, the layout of its train state on it, and its train step (not compiled yet)."""

    mesh: Mesh
    layout: train_step.StateLayout
    step: Callable  # (state, batch) -> (state, metrics)

    def compile(self, state: train_step.TrainState, batch: train_step.Batch) -> Any:
        """The step compiled for `state` and `batch` (arrays or their shapes), donating the state."""
        return train_step.compile_step(self.step, self.layout.shardings, self.mesh, state, batch)


def build(config: TrainConfig, spec: ModelSpec, *, devices: Sequence[Any] | None = None,
          lineage: Sequence[Mapping[str, Any]] = ()) -> BuiltRun:
    """The run of `config` for a model of architecture `spec` on `devices` (default: all of this
    process's cluster); `lineage` is the init checkpoint's (`optimizer.trainable: new_layers` reads it).
    Options that do not fit the model or the mesh are refused here, before anything is allocated."""
    mesh = mesh_lib.build_mesh(config.mesh, config.data.global_batch_size, spec,
                               microbatches=config.data.microbatches, devices=devices,
                               seq_len=config.data.seq_len, moe_chunks=config.model.moe_chunks,
                               moe_dispatch=config.model.moe_dispatch)
    check_spec_options(config, spec, devices)  # every phase's shape too; the mesh is the same for all
    layout = train_step.state_layout(spec, config.optimizer, mesh, lineage)
    step = train_step.make_train_step(spec, config.model.run_config(), config.loss, layout.tx, layout.schedule,
                                      len(config.data.source_names), microbatches=config.data.microbatches,
                                      trainable=layout.trainable, techniques=step_list.for_run(config, spec))
    return BuiltRun(mesh, layout, step)
