"""The continued-pretraining run: check everything, build the state, loop, checkpoint, stop cleanly.

`train(config, resume=...)` is what `upcycle continued-pretrain` runs, identically on every process.
Guarantees:
- every check of the config, the files it names, the tokenizer and the device layout happens before a
  parameter is loaded or a step compiled, and fails with one `UpcyclerError` line;
- the run directory is never a source (`upcycler.train.loop.preflight`), so a run cannot overwrite what it
  reads;
- a resumed run (`resume=True`) restores parameters, optimiser state, step and data position from the
  latest committed checkpoint and then follows bit for bit the trajectory of an uninterrupted run;
- a step whose loss or gradient norm is NaN or infinite stops the run with an error naming the step and
  the last good checkpoint; nothing computed from it is saved (with `loss.spike`, the guard decides:
  `upcycler.train.techniques.spike_guard`);
- with `metrics.stop_on_collapse`, a window in which an MoE layer lost half its experts stops the run
  naming the layer and the last checkpoint;
- SIGTERM on any process stops every process after one same step (JAX's preemption sync point when there
  are several: the step after the furthest any process had reached), saves that step and returns
  `RunResult(preempted=True)` (the CLI then exits with `PREEMPTED_EXIT_STATUS`);
- with several processes, run_dir must be one directory they all see (`run_dir.refuse_unshared`);
- what is watched during the run (metrics.jsonl and the `metrics.writers`, goodput, MFU, held-out
  evaluation, a profile) never changes what is trained: the losses and parameters are the same bit for
  bit with any of them on or off.
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
from jax.sharding import Mesh

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.io.manifest import PretrainStep, pretrain_step
from upcycler.spec import ModelSpec
from upcycler.train.config import TrainConfig
from upcycler.train.data.mix import DataIterator, make_data_iterator
from upcycler.train.loop import mesh as mesh_lib
from upcycler.train.loop.checkpointing import RunCheckpoints
from upcycler.train.loop.heldout_eval import HeldoutEval
from upcycler.train.loop.preflight import RunInputs, check_spec_options, prepare
from upcycler.train.loop.profiling import ProfileWindow
from upcycler.train.loop.remote_inputs import localized
from upcycler.train.loop.run_dir import make_run_dir
from upcycler.train.loop.train_step import (
    TrainState,
    compile_step,
    global_batch,
    make_train_step,
    state_layout,
)
from upcycler.train.model.params import from_tensors
from upcycler.train.reporting.flops import flops_per_token
from upcycler.train.reporting.goodput import RunClock, goodput
from upcycler.train.reporting.metrics_log import MetricsLog, step_record
from upcycler.train.reporting.peak import peak_per_device
from upcycler.train.reporting.progress import Progress
from upcycler.train.reporting.writers import Writer, open_writers
from upcycler.train.techniques import expert_health
from upcycler.train.techniques.expert_window import ExpertWindow
from upcycler.train.techniques.spike_guard import SpikeGuard


@dataclass
class RunResult:
    """How a run ended: the step reached, the last checkpoint written, and whether SIGTERM stopped it."""

    step: int
    last_checkpoint: Path | None
    preempted: bool = False


def train(config: TrainConfig, *, resume: bool = False, checked: RunInputs | None = None) -> RunResult:
    """Run (or resume) continued pretraining to `config.steps`; see the module docstring for guarantees.

    `checked` is the result of `prepare(config, resume)` when the caller already ran it."""
    clock = RunClock()
    with clock.timed("initialization"):
        mesh_lib.init_distributed(config.distributed)
        config = localized(config)
        checked = checked or prepare(config, resume)
        mesh = mesh_lib.build_mesh(config.mesh, config.data.global_batch_size, checked.spec,
                                   microbatches=config.data.microbatches,
                                   seq_len=config.data.seq_len, moe_chunks=config.model.moe_chunks,
                                   moe_dispatch=config.model.moe_dispatch)
        check_spec_options(config, checked.spec)  # MoE options on a dense model: before the run directory
    data = make_data_iterator(config.data, jax.process_index(), jax.process_count())
    run = None
    try:
        heldout = None
        if config.eval is not None:  # its sources are checked before the run directory is made
            heldout = HeldoutEval(config, checked.spec, data.tokenizer_sha256, jax.process_index(),
                                  jax.process_count())
        make_run_dir(config)
        run = _Run(config, checked, mesh, data, clock, heldout)
        with clock.timed("checkpoint_restore" if resume else "training_prep"):
            state = run.resumed_state() if resume else run.initial_state()
        return run.loop(state)
    finally:
        if run is not None:
            run.ckpts.close()
        data.close()


class _Run:
    """The pieces of one run: mesh, shardings, optimiser, data, checkpoints, compiled step."""

    def __init__(self, config: TrainConfig, checked: RunInputs, mesh: Mesh, data: DataIterator,
                 clock: RunClock, heldout: HeldoutEval | None):
        self.config, self.checked, self.mesh, self.data = config, checked, mesh, data
        self.clock, self.heldout = clock, heldout
        self.spec = spec = checked.spec
        self.model_cfg = config.model.run_config()
        self.layout = state_layout(spec, config.optimizer, mesh, checked.lineage)
        self.tx, self.schedule = self.layout.tx, self.layout.schedule
        self.state_shardings = self.layout.shardings
        self.ckpts = RunCheckpoints(
            config.run_dir,
            spec,
            keep=config.checkpoint.keep,
            async_save=config.checkpoint.async_save,
            lineage=checked.lineage,
            side_dirs=(checked.tokenizer.parent, checked.init),  # the tokenizer's files first, then the init's
            hf_every=config.checkpoint.hf_every,
            hf_dtype=config.checkpoint.hf_dtype,
        )
        self.rewinds: list[dict[str, Any]] = []
        self.guard = SpikeGuard(config.loss.spike) if config.loss.spike else None
        self.experts = ExpertWindow(spec, config.metrics.dead_below, data.source_names)
        self.last_lr = 0.0

    def initial_state(self) -> TrainState:
        """Step 0: the init checkpoint's tensors as float32, each device reading only its shards.

        When the init is an upcycler output, what was read is checked against its manifest's digests
        before the first step: a corrupted init is refused, naming the file.
        """
        init = self.checked.merged_init or read_checkpoint(self.checked.init)
        params = from_tensors(self.spec, init.tensors, dtype=np.float32, shardings=self.state_shardings.params)
        init.check_inputs()
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
        ema = None
        if self.config.optimizer.ema > 0:  # a copy: the step donates the parameters' buffers
            ema = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.state_shardings.params)(params)
        return TrainState(jnp.asarray(0, jnp.int32), params, opt_state, ema)

    def resumed_state(self) -> TrainState:
        """The latest committed checkpoint, placed with the run's shardings; the data iterator follows it."""
        step = self.ckpts.latest_step()
        abstract = self.layout.abstract
        saved = self.ckpts.restore(step, abstract.params, abstract.opt_state, with_ema=abstract.ema is not None)
        if ModelSpec.from_json(json.dumps(saved.meta["spec"])) != self.spec:
            raise UpcyclerError(
                f"{self.ckpts.step_dir(step)}: was trained from another model than {self.checked.init}"
            )
        self.rewinds = list(saved.meta.get("rewinds", []))
        if self.guard is not None:
            self.guard = SpikeGuard(self.config.loss.spike, _spike_window(saved.meta, self.ckpts.step_dir(step)))
        # the steps before this run's (a merge it started from, say), as the checkpoint recorded them
        self.ckpts.lineage = [dict(x) for x in saved.meta["lineage"][:-1]]
        self.data.set_state(saved.data)
        self.experts.restore(saved.meta.get("expert_window", {}), str(self.ckpts.step_dir(step)))
        return TrainState(jnp.asarray(step, jnp.int32), saved.params, saved.opt_state, saved.ema)

    def loop(self, state: TrainState) -> RunResult:
        """Train from `state` to `config.steps`, logging every step and checkpointing as configured."""
        config, primary, clock = self.config, jax.process_index() == 0, self.clock
        start = step = int(state.step)
        sources = self.data.source_names
        step_fn = make_train_step(
            self.spec, self.model_cfg, config.loss, self.tx, self.schedule, len(sources),
            microbatches=config.data.microbatches, trainable=self.layout.trainable, ema_decay=config.optimizer.ema,
        )
        batch_tokens = config.data.global_batch_size * config.data.seq_len
        flops = flops_per_token(self.spec, config.data.seq_len) * batch_tokens
        guard, experts = self.guard, self.experts
        with clock.timed("initialization"):
            peak = peak_per_device(config.metrics.peak_flops, jax.devices())
        log = _Sinks(MetricsLog(config.run_dir, enabled=primary, start_step=start))
        clock.resume(log.log.kept and log.log.kept.get("clock"), log.log.last and log.log.last.get("clock"))
        progress = Progress(enabled=primary and config.metrics.progress, start=start, total=config.steps)
        progress.note(f"{mesh_lib.describe(self.mesh)}; starting at step {start}; {peak.describe()}")
        stop = _PreemptionNotice()
        profile = ProfileWindow(config.profile, config.run_dir)
        last = self.ckpts.step_dir(start) if start else None
        compiled, baseline = None, {}
        try:
            if primary:
                log.writers = open_writers(config.metrics, config.run_dir, start_step=start,
                                           moe_layers=self.moe_layers, config=config.to_dict())
            while step < config.steps:
                profile.before(step)
                t_data = time.perf_counter()
                with clock.timed("data_loading"):
                    batch = global_batch(next(self.data), self.mesh)
                data_wait = time.perf_counter() - t_data
                if compiled is None:
                    with clock.timed("program_startup"):
                        compiled = compile_step(step_fn, self.state_shardings, self.mesh, state, batch)
                        if self.heldout is not None:
                            self.heldout.compile(state.params, self.mesh, self.state_shardings.params)
                    if self.heldout is not None and step == 0:  # the starting point of every eval curve
                        with clock.timed("eval"):
                            baseline = self.heldout.baseline(state.params, self.mesh)
                t0 = time.perf_counter()
                state, raw = compiled(state, batch)
                raw = jax.device_get(raw)
                elapsed = time.perf_counter() - t0
                clock.add("productive", elapsed)
                self.last_lr = float(raw["lr"])  # the schedule's value at this step, for the checkpoint's meta
                profile.after(step)
                spike = guard is not None and guard.is_spike(float(raw["loss"]))
                if not spike:
                    _check_finite(raw, step, last)
                experts.add(raw)
                window_ends = (step + 1) % config.metrics.expert_load_every == 0 or step + 1 == config.steps
                window = experts.take() if window_ends else None  # windows start at multiples
                record = step_record(
                    step,
                    raw,
                    sources=sources,
                    step_time=elapsed,
                    batch_tokens=batch_tokens,
                    flops_per_step=flops,
                    peak_flops=peak.flops,
                    num_devices=jax.device_count(),
                    window=window,
                )
                record.update(data_wait=data_wait, **(baseline if step == 0 else {}))
                if spike:
                    _stamp(record, clock)
                    state, last = self._spike(guard, record, step, log, progress)  # saves step + 1
                    step += 1
                    if stop.agreed(step):
                        return RunResult(step, last, preempted=True)
                    continue
                if self.heldout is not None and self.heldout.due(step):
                    with clock.timed("eval"):
                        record.update(self.heldout.run(state.params, self.mesh))
                _stamp(record, clock)
                log.write(record)
                health = (window or {}).get("expert_health")
                progress.update(record, expert_health.summary(health, self.moe_layers) if health else "")
                if health and config.metrics.stop_on_collapse:
                    _check_collapse(health, self.spec, self.moe_layers, step, last)
                step += 1
                preempted = stop.agreed(step)
                with clock.timed("checkpoint_save"):
                    saved = self._maybe_checkpoint(state, step, preempted, progress)
                if saved is not None:
                    log.saved()
                    last = saved
                if preempted:
                    return RunResult(step, last, preempted=True)
            return RunResult(step, last)
        finally:
            stop.restore()
            profile.stop()
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
        return self._save(state, step, progress)

    def _save(self, state: TrainState, step: int, progress: Progress) -> Path:
        """Save `state` as step `step`, with its lineage and meta (tokens seen, lr, rewinds so far)."""
        config = self.config
        tokens = step * config.data.global_batch_size * config.data.seq_len
        lineage = _lineage_step(config, step, self.rewinds)
        meta = {"tokens_seen": tokens, "lr": self.last_lr, "rewinds": self.rewinds,
                "spike_window": list(self.guard.recent) if self.guard is not None else [],
                "expert_window": self.experts.state()}
        self.ckpts.save(step, state.params, state.opt_state, self.data.get_state(), lineage, ema=state.ema,
                        extra_meta=meta)
        saved = self.ckpts.step_dir(step)
        progress.note(f"checkpoint {saved}")
        return saved

    @property
    def moe_layers(self) -> list[int]:
        return expert_health.moe_layer_numbers(self.spec)

    def _spike(self, guard: SpikeGuard, record: dict[str, Any], step: int, log: _Sinks,
               progress: Progress) -> tuple[TrainState, Path]:
        """Handle the spike the guard saw at `step` (its state is never saved): stop, or rewind and save.

        Returns the rewound state (its step is `step` + 1: the data goes on) and its checkpoint."""
        what = guard.describe(step, float(record["loss"]) if record["loss"] is not None else float("nan"))
        good = [n for n in self.ckpts.committed() if n < step]
        action = self.config.loss.spike.action
        chosen = good[-self.config.loss.spike.average:]
        record["spike"] = {"action": action, "median": guard.median(), "averaged": chosen}
        log.write(record)
        if action == "stop" or not good:
            names = ", ".join(str(self.ckpts.step_dir(n)) for n in chosen) or "none (no checkpoint before it)"
            later = [n for n in self.ckpts.committed() if n >= step]
            caveat = (f"; checkpoint(s) {', '.join(map(str, later))} hold the spiked state: delete them before "
                      "resuming" if later else "")
            why = "" if good else "; there is no good checkpoint to rewind to"
            raise UpcyclerError(f"loss spike: {what}; stopped without saving it{why}; the last good checkpoints "
                                f"are {names}{caveat}; lower optimizer.lr or check the data")
        for n in self.ckpts.committed():
            if n >= step:
                self.ckpts.delete(n)
        abstract = self.layout.abstract
        newest = self.ckpts.restore(chosen[-1], abstract.params, abstract.opt_state, with_ema=abstract.ema is not None)
        params = _mean([self.ckpts.restore_params(n, abstract.params) for n in chosen[:-1]] + [newest.params])
        self.rewinds.append({"step": step, "averaged": chosen})
        progress.note(f"loss spike: {what}; rewound to the average of steps {', '.join(map(str, chosen))}")
        opt_state = _with_count(newest.opt_state, step + 1)  # the schedule reads the optimiser's own count
        state = TrainState(jnp.asarray(step + 1, jnp.int32), params, opt_state, newest.ema)
        saved = self._save(state, step + 1, progress)
        log.saved()
        return state, saved


class _Sinks:
    """Where each record goes: metrics.jsonl (`MetricsLog`, the source of truth) and the other
    `metrics.writers` (opened once the loop starts; primary process only)."""

    def __init__(self, log: MetricsLog):
        self.log = log
        self.writers: list[Writer] = []

    def write(self, record: dict[str, Any]) -> None:
        self.log.write(record)
        for writer in self.writers:
            writer.write(record)

    def saved(self) -> None:
        self.log.saved()
        for writer in self.writers:
            writer.saved()

    def close(self) -> None:
        self.log.close()
        for writer in self.writers:
            writer.close()


def _stamp(record: dict[str, Any], clock: RunClock) -> None:
    """Add the run's clock so far and its goodput to `record`, just before it is written."""
    record["clock"] = clock.snapshot()
    record["goodput"] = goodput(record["clock"])


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


def _spike_window(meta: dict[str, Any], step_dir: Path) -> list[float]:
    """The loss-spike guard's window saved in a checkpoint's meta (empty when saved without a guard)."""
    window = meta.get("spike_window", [])
    if not isinstance(window, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in window
    ):
        raise UpcyclerError(f"{step_dir}: meta spike_window is not a list of finite losses; the checkpoint is "
                            "damaged; resume from an earlier step")
    return [float(x) for x in window]


def _with_count(opt_state: Any, count: int) -> Any:
    """`opt_state` with every update counter (optax's `count` fields) set to `count`: the learning-rate
    schedule and Adam's bias correction then go on from the step the run is at."""

    def reset(path, leaf):
        named = getattr(path[-1], "name", None) if path else None
        return jnp.full_like(leaf, count) if named == "count" else leaf

    return jax.tree_util.tree_map_with_path(reset, opt_state)


def _mean(trees: list[Any]) -> Any:
    """The element-wise mean of parameter trees, as a float32 running mean (one accumulator)."""
    mean = trees[0]
    for i, tree in enumerate(trees[1:], start=2):
        share = np.float32(1 / i)
        mean = jax.tree.map(lambda m, x, c=share: m + (x - m) * c, mean, tree)
    return mean


def _check_collapse(health: dict[str, Any], spec: ModelSpec, layers: list[int], step: int, last: Path | None) -> None:
    """`metrics.stop_on_collapse`: stop when a layer has lost at least half its experts in this window."""
    collapsed = expert_health.collapsed_layers(health, spec.moe.num_experts)  # type: ignore[union-attr]
    if not collapsed:
        return
    m = collapsed[0]
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    raise UpcyclerError(
        f"expert collapse at step {step}: MoE layer {layers[m]} has {health['dead'][m]} of "
        f"{spec.moe.num_experts} experts dead (load_cv {health['load_cv'][m]:.2f}); stopped; {where}; "  # type: ignore[union-attr]
        "raise loss.lb_coef or loss.bias_update_rate, or lower optimizer.lr, then resume"
    )


def _lineage_step(config: TrainConfig, step: int, rewinds: list[dict[str, Any]]) -> PretrainStep:
    o = config.optimizer
    optimizer: dict[str, Any] = {"lr": o.lr, "schedule": [vars(p) for p in o.schedule]}
    if o.trainable != "all":
        optimizer["trainable"] = o.trainable
    if o.ema:
        optimizer["ema"] = o.ema
    details: dict[str, Any] = {"rewinds": list(rewinds)} if rewinds else {}
    if config.model.init_from_merge:
        details["init_from_merge"] = config.model.init_from_merge
    return pretrain_step(
        step, step * config.data.global_batch_size * config.data.seq_len,
        data={"sources": list(config.data.source_names),
              "phases": [{"until_step": p.until_step, "weights": dict(p.weights)} for p in config.data.phases]},
        optimizer=optimizer, **details,
    )


class _PreemptionNotice:
    """SIGTERM on any process stops every process after the same step: `agreed(step)`, asked after each step
    with the same step numbers on every process, turns True on all of them at one step.

    Several processes: JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`): the
    process that got SIGTERM (JAX's own handler, installed by `jax.distributed.initialize`) tells the
    coordination service, which picks the first step every process can still reach; no collective runs per
    step. One process: a SIGTERM handler of our own, restored by `restore()`."""

    def __init__(self):
        self.hit = False
        self._shared = jax.process_count() > 1
        self._previous = None if self._shared else signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.hit = True

    def agreed(self, step: int) -> bool:
        if not self._shared:
            return self.hit
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(step))

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
