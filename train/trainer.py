"""The continued-pretraining run: check everything, build the state, loop, checkpoint, stop cleanly.

`train(config, resume=...)` is what `upcycle continued-pretrain` runs, identically on every process.
Guarantees:
- every check of the config, the files it names, the tokenizer and the device layout happens before a
  parameter is loaded or a step compiled, and fails with one `UpcyclerError` line;
- the run directory is never a source (`upcycler.train.preflight`), so a run cannot overwrite what it
  reads;
- a resumed run (`resume=True`) restores parameters, optimiser state, step and data position from the
  latest committed checkpoint and then follows bit for bit the trajectory of an uninterrupted run;
- a step whose loss or gradient norm is NaN or infinite stops the run with an error naming the step and
  the last good checkpoint; nothing computed from it is saved;
- SIGTERM finishes the current step, saves a checkpoint and exits normally.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.io.manifest import PretrainStep, pretrain_step
from upcycler.spec import ModelSpec
from upcycler.train import mesh as mesh_lib
from upcycler.train.checkpointing import RunCheckpoints
from upcycler.train.config import TrainConfig
from upcycler.train.data.mix import DataIterator, make_data_iterator
from upcycler.train.metrics import MetricsLog, Progress, flops_per_token, step_record
from upcycler.train.model.params import from_tensors
from upcycler.train.preflight import RunInputs, prepare
from upcycler.train.train_step import TrainState, compile_step, global_batch, make_train_step, state_layout
from upcycler.untrusted import shown_path


@dataclass
class RunResult:
    """How a run ended: the step reached, the last checkpoint written, and whether SIGTERM stopped it."""

    step: int
    last_checkpoint: Path | None
    preempted: bool = False


def train(config: TrainConfig, *, resume: bool = False, checked: RunInputs | None = None) -> RunResult:
    """Run (or resume) continued pretraining to `config.steps`; see the module docstring for guarantees.

    `checked` is the result of `prepare(config, resume)` when the caller already ran it."""
    mesh_lib.init_distributed(config.distributed)
    checked = checked or prepare(config, resume)
    mesh = mesh_lib.build_mesh(config.mesh, config.data.global_batch_size, checked.spec,
                               microbatches=config.data.microbatches,
                               seq_len=config.data.seq_len, moe_chunks=config.model.moe_chunks)
    data = make_data_iterator(config.data, jax.process_index(), jax.process_count())
    run = None
    try:
        _make_run_dir(config, primary=jax.process_index() == 0)
        run = _Run(config, checked, mesh, data)
        state = run.resumed_state() if resume else run.initial_state()
        return run.loop(state)
    finally:
        if run is not None:
            run.ckpts.close()
        data.close()


class _Run:
    """The pieces of one run: mesh, shardings, optimiser, data, checkpoints, compiled step."""

    def __init__(self, config: TrainConfig, checked: RunInputs, mesh: Mesh, data: DataIterator):
        self.config, self.checked, self.mesh, self.data = config, checked, mesh, data
        self.spec = spec = checked.spec
        self.model_cfg = config.model.run_config()
        self.layout = state_layout(spec, config.optimizer, mesh)
        self.tx, self.schedule = self.layout.tx, self.layout.schedule
        self.state_shardings = self.layout.shardings
        self.ckpts = RunCheckpoints(
            config.run_dir,
            spec,
            keep=config.checkpoint.keep,
            async_save=config.checkpoint.async_save,
            lineage=checked.lineage,
            tokenizer=checked.tokenizer,
        )

    def initial_state(self) -> TrainState:
        """Step 0: the init checkpoint's tensors as float32, each device reading only its shards.

        When the init is an upcycler output, what was read is checked against its manifest's digests
        before the first step: a corrupted init is refused, naming the file.
        """
        init = read_checkpoint(self.checked.init)
        params = from_tensors(self.spec, init.tensors, dtype=np.float32, shardings=self.state_shardings.params)
        init.check_inputs()
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
        return TrainState(jnp.asarray(0, jnp.int32), params, opt_state)

    def resumed_state(self) -> TrainState:
        """The latest committed checkpoint, placed with the run's shardings; the data iterator follows it."""
        step = self.ckpts.latest_step()
        abstract = self.layout.abstract
        params, opt_state, data_state, meta = self.ckpts.restore(step, abstract.params, abstract.opt_state)
        if ModelSpec.from_json(json.dumps(meta["spec"])) != self.spec:
            raise UpcyclerError(
                f"{self.ckpts.step_dir(step)}: was trained from another model than {self.checked.init}"
            )
        self.data.set_state(data_state)
        return TrainState(jnp.asarray(step, jnp.int32), params, opt_state)

    def loop(self, state: TrainState) -> RunResult:
        """Train from `state` to `config.steps`, logging every step and checkpointing as configured."""
        config, primary = self.config, jax.process_index() == 0
        start = step = int(state.step)
        sources = self.data.source_names
        step_fn = make_train_step(
            self.spec, self.model_cfg, config.loss, self.tx, self.schedule, len(sources),
            microbatches=config.data.microbatches,
        )
        batch_tokens = config.data.global_batch_size * config.data.seq_len
        flops = flops_per_token(self.spec, config.data.seq_len) * batch_tokens
        log = MetricsLog(config.run_dir, enabled=primary, start_step=start)
        progress = Progress(enabled=primary and config.metrics.progress, start=start, total=config.steps)
        progress.note(f"{mesh_lib.describe(self.mesh)}; starting at step {start}")
        stop = _SigtermFlag()
        last = self.ckpts.step_dir(start) if start else None
        compiled = None
        try:
            while step < config.steps:
                batch = global_batch(next(self.data), self.mesh)
                if compiled is None:
                    compiled = compile_step(step_fn, self.state_shardings, self.mesh, state, batch)
                t0 = time.perf_counter()
                state, raw = compiled(state, batch)
                raw = jax.device_get(raw)
                elapsed = time.perf_counter() - t0
                _check_finite(raw, step, last)
                record = step_record(
                    step,
                    raw,
                    sources=sources,
                    step_time=elapsed,
                    batch_tokens=batch_tokens,
                    flops_per_step=flops,
                    peak_flops=config.metrics.peak_flops,
                    num_devices=jax.device_count(),
                    with_load=step % config.metrics.expert_load_every == 0,
                )
                log.write(record)
                progress.update(record)
                step += 1
                preempted = stop.agreed()
                last = self._maybe_checkpoint(state, step, preempted, progress) or last
                if preempted:
                    return RunResult(step, last, preempted=True)
            return RunResult(step, last)
        finally:
            stop.restore()
            progress.close()
            log.close()

    def _maybe_checkpoint(
        self, state: TrainState, step: int, preempted: bool, progress: Progress
    ) -> Path | None:
        """Save `state` as step `step` when the schedule, the last step or a preemption asks for it.

        Returns the checkpoint's directory, or None when this step is not saved.
        """
        config = self.config
        if not (step % config.checkpoint.every == 0 or step == config.steps or preempted):
            return None
        lineage = _lineage_step(config, step)
        self.ckpts.save(step, state.params, state.opt_state, self.data.get_state(), lineage)
        saved = self.ckpts.step_dir(step)
        progress.note(f"checkpoint {saved}")
        return saved


def _check_finite(raw: dict[str, Any], step: int, last: Path | None) -> None:
    """Stop the run (before anything of step `step` is saved) when its loss or gradient norm is not finite."""
    if np.isfinite(raw["total_loss"]) and np.isfinite(raw["grad_norm"]):
        return
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    raise UpcyclerError(
        f"loss is {float(raw['total_loss'])} (grad norm {float(raw['grad_norm'])}) at step "
        f"{step}; stopped without saving it; {where}; lower optimizer.lr or check the data, "
        "then resume"
    )


def _make_run_dir(config: TrainConfig, primary: bool) -> None:
    """Create RUN_DIR; the primary process also writes RUN_DIR/config.yaml, the config the run uses."""
    try:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        if primary:
            (config.run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    except OSError as err:
        raise UpcyclerError(
            f"{shown_path(config.run_dir)}: cannot write the run directory ({err.strerror}); "
            "choose a writable run_dir"
        ) from None


def _lineage_step(config: TrainConfig, step: int) -> PretrainStep:
    return pretrain_step(
        step, step * config.data.global_batch_size * config.data.seq_len,
        data={"sources": list(config.data.source_names),
              "phases": [{"until_step": p.until_step, "weights": dict(p.weights)} for p in config.data.phases]},
        optimizer={"lr": config.optimizer.lr, "schedule": [vars(p) for p in config.optimizer.schedule]},
    )


class _SigtermFlag:
    """Records SIGTERM; `agreed()` is True on every process as soon as any process got one."""

    def __init__(self):
        self.hit = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.hit = True

    def agreed(self) -> bool:
        if jax.process_count() == 1:
            return self.hit
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.asarray(self.hit))))

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
