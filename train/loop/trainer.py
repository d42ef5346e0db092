"""The continued-pretraining run: check everything, build the state, loop, checkpoint, stop cleanly.

`train(config, resume=...)` is what `upcycle continued-pretrain` runs, identically on every process.
Guarantees:
- every check of the config, the files it names, the tokenizer and the device layout happens before a
  parameter is loaded or a step compiled, and fails with one `UpcyclerError` line;
- a step that needs more memory per device than a device has is refused in one line before a parameter is
  loaded (`memory_check`: the step is compiled first, for every data phase shape still to come);
- the run directory is never a source (`upcycler.train.loop.preflight`), so a run cannot overwrite what it
  reads;
- a resumed run (`resume=True`) restores parameters, optimiser state, step and data position from the
  latest committed checkpoint and then follows bit for bit the trajectory of an uninterrupted run;
- a step whose loss or gradient norm is NaN or infinite stops the run with an error naming the step and
  the last good checkpoint; nothing computed from it is saved (`techniques.finiteness`; with
  `loss.spike`, the guard decides: `techniques.spike_guard`);
- with `metrics.stop_on_collapse`, a window in which an MoE layer lost half its experts stops the run
  naming the layer and the last checkpoint (`techniques.expert_window`);
- SIGTERM on any process stops every process after one same step (`techniques.preemption`), saves that
  step and returns `RunResult(preempted=True)` (the CLI then exits with `PREEMPTED_EXIT_STATUS`);
- with several processes, run_dir must be one directory they all see (`run_dir.refuse_unshared`);
- one run at a time per run_dir: a second run on it is refused, naming the first (`run_dir.lock_run_dir`);
- what is watched during the run (metrics.jsonl and the `metrics.writers`, goodput, MFU, held-out
  evaluation, a profile) never changes what is trained: the losses and parameters are the same bit for
  bit with any of them on or off.

The loop is the step, the clock and the actions; the rest rides on it as techniques, walked in order at
each point of the step (`upcycler.train.techniques.protocol`), their states saved in every checkpoint.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.spec import ModelSpec
from upcycler.train.config import TrainConfig
from upcycler.train.data.mix import DataIterator, make_data_iterator
from upcycler.train.loop import checkpointing as ckpt
from upcycler.train.loop import memory_check, phases, run_build
from upcycler.train.loop import mesh as mesh_lib
from upcycler.train.loop.heldout_eval import HeldoutEval
from upcycler.train.loop.preflight import RunInputs, prepare
from upcycler.train.loop.remote_inputs import localized
from upcycler.train.loop.rewind import rewound_state
from upcycler.train.loop.run_dir import lock_run_dir, make_run_dir
from upcycler.train.loop.train_step import TrainState, global_batch
from upcycler.train.model.params import from_tensors
from upcycler.train.reporting.goodput import RunClock, stamp
from upcycler.train.reporting.metrics_log import MetricsLog, step_record
from upcycler.train.reporting.peak import peak_per_device
from upcycler.train.reporting.progress import Progress
from upcycler.train.reporting.writers import RecordSinks, open_writers, trace_location
from upcycler.train.techniques.checkpoint_schedule import CheckpointSchedule
from upcycler.train.techniques.expert_health import moe_layer_numbers
from upcycler.train.techniques.expert_window import ExpertWatch
from upcycler.train.techniques.finiteness import FinitenessCheck
from upcycler.train.techniques.heldout import HeldoutEvaluation
from upcycler.train.techniques.preemption import Preemption
from upcycler.train.techniques.profile_window import ProfileWindow
from upcycler.train.techniques.protocol import FINISH, SAVE, STOP, Rewind, StepContext, Technique, walk
from upcycler.train.techniques.spike_guard import SpikeGuard


@dataclass
class RunResult:
    """How a run ended: the step reached, the last checkpoint written, whether SIGTERM stopped it, and
    the programs it compiled (`train_step.program_fingerprint`, one per data phase shape met)."""

    step: int
    last_checkpoint: Path | None
    preempted: bool = False
    programs: tuple[str, ...] = ()


def train(config: TrainConfig, *, resume: bool = False, checked: RunInputs | None = None) -> RunResult:
    """Run (or resume) continued pretraining to `config.steps`; see the module docstring for guarantees.

    `checked` is the result of `prepare(config, resume)` when the caller already ran it."""
    clock = RunClock()
    with clock.timed("initialization"):
        mesh_lib.init_distributed(config.distributed)
        config = localized(config)
        checked = checked or prepare(config, resume)
        # the mesh, layout and step (MoE options on a dense model refused): before the run directory
        built = run_build.build(config, checked.spec, lineage=checked.lineage)
        mesh, steps = built.mesh, phases.CompiledSteps(built)  # compiled once per data phase shape
    if not resume:  # before anything is allocated or a directory made
        memory_check.check_step_memory(config, built, steps, 0, clock)
    data = make_data_iterator(config.data, *mesh_lib.data_shard(mesh))
    run, held = None, None
    try:
        heldout = None if config.eval is None else HeldoutEval(  # its sources checked before the run directory
            config, checked.spec, data.tokenizer_sha256, *mesh_lib.data_shard(mesh))
        held = lock_run_dir(config, resume=resume)  # one run at a time, until its last save is done
        make_run_dir(config)
        run = _Run(config, checked, built, data, clock, heldout)
        with clock.timed("checkpoint_restore" if resume else "training_prep"):
            if resume:
                memory_check.check_step_memory(config, built, steps, run.ckpts.latest_step() or 0, clock)
            state = run.resumed_state() if resume else run.initial_state()
        return run.loop(state, steps)
    finally:
        try:
            if run is not None:
                run.ckpts.close()
            data.close()
        finally:
            if held is not None:
                held.close()


class _Run:
    """The pieces of one run: mesh, shardings, optimiser, data, checkpoints, techniques, compiled step."""

    def __init__(self, config: TrainConfig, checked: RunInputs, built: run_build.BuiltRun, data: DataIterator,
                 clock: RunClock, heldout: HeldoutEval | None):
        self.config, self.checked, self.built, self.data, self.clock = config, checked, built, data, clock
        self.mesh, self.spec, self.layout = built.mesh, checked.spec, built.layout
        self.state_shardings = self.layout.shardings
        c = config.checkpoint  # side files: the tokenizer's first, then the init's
        self.ckpts = ckpt.RunCheckpoints(
            config.run_dir, self.spec, keep=c.keep, async_save=c.async_save, lineage=checked.lineage,
            side_dirs=(checked.tokenizer.parent, checked.init), hf_every=c.hf_every, hf_dtype=c.hf_dtype)
        evaluation = [HeldoutEvaluation(heldout, self.mesh, self.state_shardings.params)] if heldout else []
        self.techniques: list[Technique] = [  # in the order they are walked; preemption joins in `loop`
            ProfileWindow(config.profile, *trace_location(config.run_dir)), *evaluation, SpikeGuard(config.loss.spike),
            FinitenessCheck(), ExpertWatch(self.spec, config.metrics, config.steps, data.source_names),
            CheckpointSchedule(config.checkpoint.every, config.steps),
        ]
        self.last_lr = 0.0

    def initial_state(self) -> TrainState:
        """Step 0: the init checkpoint's tensors as float32, each device reading only its shards.

        When the init is an upcycler output, what was read is checked against its manifest's digests
        before the first step: a corrupted init is refused, naming the file.
        """
        init = self.checked.merged_init or read_checkpoint(self.checked.init)
        params = from_tensors(self.spec, init.tensors, dtype=np.float32, shardings=self.state_shardings.params)
        init.check_inputs()
        opt_state = jax.jit(self.layout.tx.init, out_shardings=self.state_shardings.opt_state)(params)
        ema = None
        if self.config.optimizer.ema > 0:  # a copy: the step donates the parameters' buffers
            ema = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.state_shardings.params)(params)
        return TrainState(jnp.asarray(0, jnp.int32), params, opt_state, ema)

    def resumed_state(self) -> TrainState:
        """The latest committed checkpoint, placed with the run's shardings; the data iterator and the
        techniques follow it."""
        step = self.ckpts.latest_step()
        abstract = self.layout.abstract
        saved = self.ckpts.restore(step, abstract.params, abstract.opt_state, with_ema=abstract.ema is not None)
        if ModelSpec.from_json(json.dumps(saved.meta["spec"])) != self.spec:
            raise UpcyclerError(
                f"{self.ckpts.step_dir(step)}: was trained from another model than {self.checked.init}"
            )
        ckpt.restore_techniques(self.techniques, saved.meta, self.ckpts.step_dir(step))
        # the steps before this run's (a merge it started from, say), as the checkpoint recorded them
        self.ckpts.lineage = [dict(x) for x in saved.meta["lineage"][:-1]]
        ckpt.restore_data(self.data, saved.data, self.ckpts.step_dir(step))
        return TrainState(jnp.asarray(step, jnp.int32), saved.params, saved.opt_state, saved.ema)

    def loop(self, state: TrainState, steps: phases.CompiledSteps) -> RunResult:
        """Train from `state` to `config.steps` with `steps` (compiled so far), logging every step and acting
        on what the techniques ask."""
        config, primary, clock = self.config, jax.process_index() == 0, self.clock
        start = step = int(state.step)
        sources = self.data.source_names
        with clock.timed("initialization"):
            peak = peak_per_device(config.metrics.peak_flops, jax.devices())
        log = RecordSinks(MetricsLog(config.run_dir, enabled=primary, start_step=start))
        clock.resume(log.log.kept and log.log.kept.get("clock"), log.log.last and log.log.last.get("clock"))
        progress = Progress(enabled=primary and config.metrics.progress, start=start, total=config.steps)
        progress.note(f"{mesh_lib.describe(self.mesh)}; starting at step {start}; {peak.describe()}")
        techniques = [*self.techniques, Preemption()]  # SIGTERM is heard from here until `close`
        last = self.ckpts.step_dir(start) if start else None
        try:
            if primary:
                log.writers = open_writers(config.metrics, config.run_dir, start_step=start,
                                           moe_layers=moe_layer_numbers(self.spec), config=config.to_dict())
            while step < config.steps:
                ctx = StepContext(step, last_checkpoint=last, checkpoints=self.ckpts, clock=clock)
                walk(techniques, "before_step", ctx)
                t_data = time.perf_counter()
                with clock.timed("data_loading"):
                    batch = global_batch(next(self.data), self.mesh)
                data_wait = time.perf_counter() - t_data
                steps.compile(state, batch, clock)  # a shape met for the first time (the memory check
                if step == start:  # compiled those it foresaw); the techniques start with the first step
                    ctx.params = state.params
                    walk(techniques, "start", ctx)
                t0 = time.perf_counter()
                state, raw = steps.for_batch(batch)(state, batch)
                ctx.raw = raw = jax.device_get(raw)
                elapsed = time.perf_counter() - t0
                clock.add("productive", elapsed)
                self.last_lr = float(raw["lr"])  # the schedule's value at this step, for the checkpoint's meta
                batch_tokens, flops = phases.step_size(self.spec, config.data, step)
                ctx.params, ctx.record = state.params, step_record(
                    step, raw, sources=sources, step_time=elapsed, batch_tokens=batch_tokens,
                    flops_per_step=flops, peak_flops=peak.flops, num_devices=jax.device_count())
                walk(techniques, "after_step", ctx)
                ctx.record["data_wait"] = data_wait
                walk(techniques, "before_write", ctx)
                stamp(ctx.record, clock)
                ctx.record.update(ctx.discarded or {})
                log.write(ctx.record)
                if ctx.discarded is None:
                    progress.update(ctx.record, ctx.progress)
                actions = walk(techniques, "after_write", ctx)
                for action in actions:
                    if isinstance(action, Rewind):
                        state = rewound_state(self.ckpts, self.layout, action.to, step)
                        progress.note(action.why)
                        last = self._save(state, step + 1, progress)  # the rewound state, saved at once
                        log.saved()
                step += 1
                if ctx.discarded is None and {SAVE, STOP, FINISH} & set(actions):
                    with clock.timed("checkpoint_save"):
                        last = self._save(state, step, progress)
                    log.saved()
                if STOP in actions or FINISH in actions:
                    return RunResult(step, last, preempted=FINISH not in actions, programs=tuple(steps.fingerprints))
            return RunResult(step, last, programs=tuple(steps.fingerprints))
        finally:
            for t in reversed(techniques):
                t.close()
            progress.close()
            log.close()

    def _save(self, state: TrainState, step: int, progress: Progress) -> Path:
        """Save `state` as step `step`, with its lineage and meta (tokens seen, lr, the techniques' states)."""
        config = self.config
        tokens = config.data.tokens_before(step)
        meta = {"tokens_seen": tokens, "lr": self.last_lr, **ckpt.techniques_meta(self.techniques)}
        lineage = ckpt.lineage_step(config, step, meta.get("rewinds", []))
        self.ckpts.save(step, state.params, state.opt_state, self.data.get_state(), lineage, ema=state.ema,
                        extra_meta=meta)
        saved = self.ckpts.step_dir(step)
        progress.note(f"checkpoint {saved}")
        return saved
