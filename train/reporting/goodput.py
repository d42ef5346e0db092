"""Goodput: where a run's wall time went, per category, over its whole history across restarts.

The categories follow Google's `ml-goodput-measurement` (the library MaxText reports with; it needs Cloud
Logging, so the trainer keeps its own ledger in the metrics log and uses the library's definitions):

    productive          the compiled train steps (`step_time`): the goodput
    initialization      distributed start-up, mesh, device layout (TPU_INITIALIZATION)
    training_prep       building the first state from the init checkpoint (TRAINING_PREP)
    checkpoint_restore  reading the state back on a resume (UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME)
    program_startup     compiling the step, and the evaluation step (PROGRAM_STARTUP)
    data_loading        the loop waiting for its next batch (DATA_LOADING_SYNC)
    checkpoint_save     the loop stalled by a checkpoint save (UNPRODUCTIVE_CHECKPOINT_SAVE_TIME)
    eval                held-out evaluation during training (a CUSTOM_BADPUT_EVENT)
    wasted_progress     steps computed after the last checkpoint of an attempt that died: recomputed by
                        the next one (WASTED_PROGRESS_FROM_DISRUPTION)
    recovery            from the last record an attempt wrote to the start of the next
                        (INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION)
    other               the rest: logging, host work between steps

Every record of `metrics.jsonl` carries `clock`: these categories in seconds, cumulative since the run's
first attempt started, plus `total` (their sum) and `wall` (Unix time when the record was written), and
`goodput` = productive / total. Each record counts the time up to its own writing, so a checkpoint saved
after step s is in the clock of step s + 1.

A resumed attempt starts from the clock of the last record it keeps (the step before its checkpoint) and
the last record the previous attempt wrote (which may be later: those steps are thrown away). The time
the previous attempt spent up to that last record stays in its categories, except that the productive
time of the thrown-away steps moves to `wasted_progress`; the time from that record to this attempt's
start is `recovery`. In a bucket run_dir the records after the last checkpoint were never written
(`metrics_objects`), so the thrown-away steps count as recovery there.

Export to Hugging Face (`checkpoint.hf_every`) runs in the background at low priority and shows only as
slower steps. Time is measured on the primary process, whose step waits for every other's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

CATEGORIES = (
    "productive", "initialization", "training_prep", "checkpoint_restore", "program_startup", "data_loading",
    "checkpoint_save", "eval", "wasted_progress", "recovery", "other",
)
_TRACKED = tuple(c for c in CATEGORIES if c != "other")


class RunClock:
    """Seconds per category since the run's first attempt (see the module docstring); `timed(category)`
    measures a block, `add` a duration measured elsewhere, `snapshot()` gives a record's `clock`."""

    def __init__(self) -> None:
        self._mono0 = time.monotonic()
        self._wall0 = time.time()
        self._seconds = dict.fromkeys(_TRACKED, 0.0)
        self._before = 0.0  # total of the earlier attempts, including the recovery gap

    @contextmanager
    def timed(self, category: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(category, time.monotonic() - t0)

    def add(self, category: str, seconds: float) -> None:
        self._seconds[category] += max(seconds, 0.0)

    def resume(self, kept: Mapping[str, Any] | None, last: Mapping[str, Any] | None) -> None:
        """Carry the history of earlier attempts: `kept` is the clock of the last record this attempt keeps,
        `last` that of the last record the previous attempt wrote (None when there is none or it has no
        clock: a log from before goodput was recorded, which then starts from zero)."""
        if last is None:
            return
        kept = kept or {}
        prior = {c: float(last.get(c, 0.0)) for c in CATEGORIES}
        thrown = max(prior["productive"] - float(kept.get("productive", prior["productive"])), 0.0)
        prior["productive"] -= thrown
        prior["wasted_progress"] += thrown
        prior["recovery"] += max(self._wall0 - float(last["wall"]), 0.0)
        for c in _TRACKED:
            self._seconds[c] += prior[c]
        self._before = sum(prior.values())

    def snapshot(self) -> dict[str, float]:
        """The record's `clock`: cumulative seconds per category, `total` and `wall`."""
        total = self._before + (time.monotonic() - self._mono0)
        tracked = sum(self._seconds.values())
        clock = {c: round(v, 6) for c, v in self._seconds.items()}
        clock["other"] = round(max(total - tracked, 0.0), 6)
        clock["total"] = round(max(total, tracked), 6)
        clock["wall"] = round(time.time(), 6)
        return clock


def stamp(record: dict[str, Any], clock: RunClock) -> None:
    """Add the run's clock so far and its goodput to `record`, just before it is written."""
    record["clock"] = clock.snapshot()
    record["goodput"] = goodput(record["clock"])


def goodput(clock: Mapping[str, float]) -> float:
    """Productive share of the run's wall time so far."""
    return clock["productive"] / clock["total"] if clock["total"] > 0 else 0.0


def badput(clock: Mapping[str, float]) -> dict[str, float]:
    """Each non-productive category's share of the run's wall time so far."""
    total = clock["total"]
    return {c: (clock[c] / total if total > 0 else 0.0) for c in CATEGORIES if c != "productive"}
