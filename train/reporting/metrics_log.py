"""The writer of `RUN_DIR/metrics.jsonl`: one JSON line per step, from the primary process only.

`step_record` makes a step's record from the train step's host metrics (what each field means is
`metrics`, the format's one description) and `MetricsLog` appends it, a value that is not finite written
as null. In a bucket run_dir, where nothing can be appended, it keeps the lines since the last checkpoint
and writes them as one object when a checkpoint is saved (`metrics_objects`). Opening the log first cuts
it back to the run's start step (`metrics_resume`).

What this module preserves: each line is `json.dumps` of its record, the same bytes in a local and a
bucket run_dir; the log describes one uninterrupted trajectory; a bucket write that fails ends the run
with one line naming the run_dir.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from upcycler.bucket_client import refusals
from upcycler.errors import UpcyclerError
from upcycler.locations import is_remote
from upcycler.train.reporting import metrics_objects, metrics_resume
from upcycler.train.reporting.metrics import METRICS_FILE, TECHNIQUE_PREFIX
from upcycler.untrusted import describe, shown_path


class MetricsLog:
    """Appends one JSON line per step to RUN_DIR/metrics.jsonl (a no-op on non-primary processes); in a
    bucket run_dir, keeps the lines since the last checkpoint and writes them as one object when the
    trainer says a checkpoint was saved (`saved`) and at `close` (`metrics_objects`).

    Opening it drops the records at or after `start_step` (`metrics_resume`); `kept` and `last` are then
    the last record kept and the last record there was (each None when there is none), for the goodput
    clock."""

    def __init__(self, run_dir: Path, *, enabled: bool, start_step: int):
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.kept: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self._file: TextIO | None = None
        self._pending: tuple[list[int], list[str]] | None = None  # bucket run_dir: (steps, lines) not written
        if enabled and is_remote(run_dir):
            self.kept, self.last = metrics_resume.truncate_objects(run_dir, start_step)
            self._pending = ([], [])
        elif enabled:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.kept, self.last = metrics_resume.truncate_file(self.path, start_step)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
            except OSError as err:
                raise UpcyclerError(
                    f"{shown_path(self.path)}: cannot write ({err.strerror}); choose a writable run_dir"
                ) from None

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(_finite(record), allow_nan=False) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        elif self._pending is not None:
            self._pending[0].append(int(record["step"]))
            self._pending[1].append(line)

    def saved(self) -> None:
        """A checkpoint was saved: in a bucket run_dir, write the lines since the previous one. A write the
        bucket refuses (once retried) is one line naming the run_dir; nothing more is written after it."""
        if self._pending is not None:
            steps, lines = self._pending
            try:
                metrics_objects.write_interval(self.run_dir, steps, lines)
            except refusals() as err:
                self._pending = None  # `close` does not try again: the run ends on this error
                raise UpcyclerError(
                    f"{self.run_dir}: writing the metrics of steps {steps[0]}-{steps[-1]} failed "
                    f"({describe(str(err).strip() or type(err).__name__, 200)}); check that run_dir can be "
                    "written (credentials, permissions, quota, the network), then run the same command again: "
                    "it resumes from the last committed step, without these steps' metrics") from None
            self._pending = ([], [])

    def close(self) -> None:
        self.saved()
        if self._file is not None:
            self._file.close()
            self._file = None


def step_record(
    step: int,
    raw: Mapping[str, Any],
    *,
    sources: Sequence[str],
    step_time: float,
    batch_tokens: int,
    flops_per_step: float,
    peak_flops: float | None,
    num_devices: int,
    window: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON record of one step from the train step's (host) metric arrays, with the expert window that
    ends here (`ExpertWindow.take`), when given."""
    rec: dict[str, Any] = {"step": step, "loss": float(raw["loss"])}
    src_loss, src_tokens = np.asarray(raw["source_loss"]), np.asarray(raw["source_tokens"])
    for name, loss_sum, count in zip(sources, src_loss, src_tokens):
        if count > 0:
            rec[f"loss/{name}"] = float(loss_sum / count)
    for key in ("lb_loss", "z_loss"):
        if key in raw:
            rec[key] = float(raw[key])
    rec.update({key: float(value) for key, value in raw.items() if key.startswith(TECHNIQUE_PREFIX)})
    rec.update(
        total_loss=float(raw["total_loss"]),
        grad_norm=float(raw["grad_norm"]),
        lr=float(raw["lr"]),
        tokens=int(raw["tokens"]),
        step_time=step_time,
        tokens_per_s=batch_tokens / step_time,
    )
    if peak_flops:
        rec["mfu"] = flops_per_step / step_time / (peak_flops * num_devices)
    if window:
        rec.update(window)
    return rec


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
