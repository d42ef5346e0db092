"""Mirrors of the metrics log for the tools a team watches a run in: TensorBoard and Weights & Biases.

`metrics.jsonl` (`upcycler.train.reporting.metrics_log.MetricsLog`) stays the record `upcycle report` and a
resume read; the writers chosen in `metrics.writers` get the same records as they are written, on the
primary process only, and are never read back by the trainer.

- tensorboard: event files written by tensorboardX into RUN_DIR/tensorboard (for a bucket run_dir, into a
  local directory of the upcycler cache, uploaded there after every checkpoint and at the end: an object
  store cannot append; with Orbax's `commit_success.txt` beside them, since Orbax deletes every
  directory of a bucket run_dir without one, as an unfinished checkpoint, when a run starts). A resumed run opens its writer with `purge_step` = its start step, so TensorBoard
  drops what an interrupted attempt logged after its last checkpoint. Scalars are `scalars(record)`;
  the expert load of each MoE layer also goes in as a histogram over the experts and, for all layers, as
  an image (rows: layers, columns: experts, brightness: share of the busiest expert).
- wandb: `wandb.init` with the `metrics.wandb` options, an id derived from run_dir (a resumed run logs
  into the same W&B run) and its files under RUN_DIR/wandb (the cache for a bucket run_dir);
  `mode: offline` writes a local run that `wandb sync` uploads later. Same scalars, same steps.

What is preserved: every scalar has the value of the metrics.jsonl record (TensorBoard stores float32).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.locations import is_remote
from upcycler.train.config import MetricsConfig
from upcycler.train.reporting.goodput import badput
from upcycler.train.reporting.metrics import NUMBER_FIELDS, NUMBER_PREFIXES
from upcycler.train.reporting.metrics_log import MetricsLog

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


def scalars(record: Mapping[str, Any], moe_layers: Sequence[int] = ()) -> dict[str, float]:
    """The scalars of one metrics record, by the names TensorBoard and W&B show: the number fields,
    `loss/<source>`, `eval/loss/<source>` and `eval/ppl/<source>` (and the starting point's
    `eval_start/…`), `badput/<category>` (shares of the
    run's time so far, from `clock`) and `expert_health/<statistic>/layer_<n>` (n: the MoE layer's number
    in the model). Nulls (non-finite values) are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if (key in NUMBER_FIELDS or key.startswith(NUMBER_PREFIXES)) and value is not None:
            out[key] = float(value)
    if "clock" in record:
        out.update({f"badput/{c}": share for c, share in badput(record["clock"]).items()})
    for stat, values in record.get("expert_health", {}).items():
        for k, value in enumerate(values):
            if value is not None:
                layer = moe_layers[k] if k < len(moe_layers) else k
                out[f"expert_health/{stat}/layer_{layer}"] = float(value)
    return out


class Writer(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...
    def saved(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardWriter:
    """Event files of the run (see the module docstring)."""

    def __init__(self, run_dir: Path, start_step: int, moe_layers: Sequence[int]):
        from tensorboardX import SummaryWriter

        self.run_dir, self.moe_layers = run_dir, list(moe_layers)
        self.logdir = local_mirror(run_dir) / TENSORBOARD_DIR if is_remote(run_dir) else run_dir / TENSORBOARD_DIR
        self._writer = SummaryWriter(str(self.logdir), purge_step=start_step or None, flush_secs=30)

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        wall = record.get("clock", {}).get("wall")
        for name, value in scalars(record, self.moe_layers).items():
            self._writer.add_scalar(name, value, step, walltime=wall)
        load = record.get("expert_load")
        if load is not None:
            shares = np.asarray(load, np.float64)
            for k, row in enumerate(shares):
                layer = self.moe_layers[k] if k < len(self.moe_layers) else k
                self._writer.add_histogram(f"expert_load/layer_{layer}", row, step, walltime=wall)
            image = shares / max(float(shares.max()), 1e-12)
            self._writer.add_image("expert_load", image, step, walltime=wall, dataformats="HW")

    def saved(self) -> None:
        self._writer.flush()
        if is_remote(self.run_dir):
            upload_tree(self.logdir, self.run_dir / TENSORBOARD_DIR)

    def close(self) -> None:
        self._writer.close()
        if is_remote(self.run_dir):
            upload_tree(self.logdir, self.run_dir / TENSORBOARD_DIR)


class WandbWriter:
    """A Weights & Biases run (see the module docstring)."""

    def __init__(self, run_dir: Path, options: Any, config: Mapping[str, Any], moe_layers: Sequence[int]):
        try:
            import wandb
        except ImportError:
            raise UpcyclerError("metrics.writers: wandb needs the wandb package; pip install 'upcycler[wandb]' "
                                "or drop wandb from metrics.writers") from None
        self.moe_layers = list(moe_layers)
        where = local_mirror(run_dir) if is_remote(run_dir) else Path(run_dir)
        (where / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        try:
            self._run = wandb.init(
                project=options.project, entity=options.entity, name=options.name or Path(str(run_dir)).name,
                id=run_id(run_dir), resume="allow", dir=str(where / WANDB_DIR), mode=options.mode,
                config=dict(config), settings=settings,
            )
        except Exception as err:  # noqa: BLE001 (wandb raises many types: no login, no network, bad entity)
            raise UpcyclerError(f"metrics.wandb: cannot start the W&B run ({err}); log in with `wandb login`, "
                                "or set metrics.wandb.mode to offline") from None

    def write(self, record: Mapping[str, Any]) -> None:
        self._run.log(scalars(record, self.moe_layers), step=int(record["step"]))

    def saved(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def open_writers(options: MetricsConfig, run_dir: Path, *, start_step: int, moe_layers: Sequence[int],
                 config: Mapping[str, Any]) -> list[Writer]:
    """The writers of `metrics.writers` other than jsonl (which `MetricsLog` is), opened."""
    writers: list[Writer] = []
    if "tensorboard" in options.writers:
        writers.append(TensorBoardWriter(run_dir, start_step, moe_layers))
    if "wandb" in options.writers:
        writers.append(WandbWriter(run_dir, options.wandb, config, moe_layers))
    return writers


class RecordSinks:
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


def run_id(run_dir: Path) -> str:
    """A W&B run id that is the same for every attempt of the run in `run_dir`."""
    return hashlib.sha256(str(run_dir).rstrip("/").encode()).hexdigest()[:16]


def local_mirror(run_dir: Path) -> Path:
    """The local directory, in the upcycler cache, that holds what is uploaded to a bucket run_dir."""
    from upcycler.io.remote_sources import cache_root

    return cache_root() / "runs" / run_id(run_dir)


def trace_location(run_dir: Path) -> tuple[Path, Callable[[], None] | None]:
    """Where a profile trace of the run in `run_dir` is written (RUN_DIR/tensorboard, or its local mirror
    for a bucket run_dir) and what uploads it when it stops (None: written in place)."""
    if not is_remote(run_dir):
        return Path(run_dir) / TENSORBOARD_DIR, None
    local = local_mirror(run_dir) / TENSORBOARD_DIR
    return local, lambda: upload_tree(local, run_dir / TENSORBOARD_DIR)


ORBAX_COMMIT_FILE = "commit_success.txt"


def upload_tree(local: Path, remote: Path) -> None:
    """Every file under `local` written to the same relative name under the bucket prefix `remote`, then
    Orbax's commit file at the top of `remote` (so Orbax never takes the directory for an unfinished
    checkpoint and deletes it when a run starts)."""
    from upcycler.io import object_store

    base = str(remote).rstrip("/")
    pairs = [(path, f"{base}/{path.relative_to(local).as_posix()}")
             for path in (Path(root) / name for root, _, names in os.walk(local) for name in names)]
    if pairs:
        object_store.upload_all(pairs)
        object_store.write_bytes(f"{base}/{ORBAX_COMMIT_FILE}", b"not a checkpoint: TensorBoard's files\n")
