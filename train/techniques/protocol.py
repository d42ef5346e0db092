"""The technique protocol: what rides on the training loop is one `Technique` object each, and the loop
walks the list of them at fixed points of every step.

A step, as the loop runs it (`upcycler.train.loop.trainer`):

    before_step(ctx)    before the batch is read (a profile window starts)
    start(ctx)          once, when the step is compiled, before this process's first step runs
                        (held-out evaluation compiles, and measures the starting point)
    after_step(ctx)     the step ran: its host metrics are `ctx.raw` and its record `ctx.record` holds the
                        step's own figures; a technique checks them (and may raise `UpcyclerError` to stop
                        the run before anything of the step is saved), adds its own figures, or discards
                        the step (`ctx.discard`: a loss spike)
    before_write(ctx)   the record is about to be written: figures measured outside the step (held-out
                        evaluation)
    after_write(ctx)    the record is written: a technique stops the run (raises) or returns an `Action`
                        for the loop: `SAVE` this step, `STOP` (save it and end the run: preempted, to be
                        resumed), `FINISH` (save it and end the run as finished: nothing to resume), or
                        `Rewind` to the average of earlier checkpoints
    close()             the run ends, however it ends (in the reverse order of the list)

Techniques are called in the order of the list, each hook in turn, so a later technique sees what an
earlier one recorded (`ctx.discarded`). What a technique carries across a checkpoint is `state()`: its
entries of the checkpoint's meta, under the keys it declares in `meta_keys` (no two techniques share
one); a resumed run gives each technique back its entries (`restore`, as `MetaEntries`), and a technique
restores an entry missing from an older checkpoint to its start. What a checkpoint holds is never
trusted: every entry is read through `MetaEntries`, which checks its type, shape and range against the
run and refuses in one line naming the checkpoint and the key, so nothing damaged reaches the run or is
carried into the next checkpoint. `upcycler.train.loop.checkpointing` owns the meta.

This module imports nothing of the loop: a technique is read and tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from upcycler.errors import UpcyclerError


class Checkpoints(Protocol):
    """What a technique may ask of the run's checkpoints: the committed steps and their directories."""

    def committed(self) -> list[int]: ...

    def step_dir(self, step: int) -> Path: ...


@dataclass(frozen=True)
class Action:
    """What a technique asks of the loop after a step: `SAVE` it, `STOP` (save it, end the run: preempted)
    or `FINISH` (save it, end the run: finished)."""

    kind: str


SAVE = Action("save")
STOP = Action("stop")  # preempted: save this step and end the run, to be resumed
FINISH = Action("finish")  # done early: save this step and end the run as finished, as if it reached `steps`


@dataclass(frozen=True)
class Rewind(Action):
    """Go back to the average of the checkpoints `to` (oldest first); the step counter and the data go on,
    and the rewound state is saved at once. `why` is the progress line's account of it."""

    kind: str = "rewind"
    to: tuple[int, ...] = ()
    why: str = ""


@dataclass
class StepContext:
    """One step as the techniques see it (see the module docstring for when each field is set)."""

    step: int  # the step (0-based) that runs or just ran
    params: Any = None  # the parameters: before the first step at `start`, after the step later
    raw: Mapping[str, Any] = field(default_factory=dict)  # the step's host metrics
    record: dict[str, Any] = field(default_factory=dict)  # its metrics record, not yet written
    last_checkpoint: Path | None = None  # the newest checkpoint this run has saved or resumed from
    checkpoints: Checkpoints | None = None
    clock: Any = None  # the run's `RunClock`: `clock.timed(category)` for time spent outside the step
    progress: str = ""  # what this step adds to the progress line
    discarded: dict[str, Any] | None = None  # set by `discard`: the record's last fields

    def discard(self, fields: Mapping[str, Any]) -> None:
        """Throw the step away (its state is never saved); `fields` go last on its record."""
        self.discarded = dict(fields)


class MetaEntries:
    """A technique's entries of one checkpoint's meta (`state`), saved at `step` in the checkpoint `where`,
    read against the run: each read checks what it returns and refuses in one `UpcyclerError` line naming
    the checkpoint and the key (`refuse`); what it returns is plain data of the checked type."""

    def __init__(self, state: Mapping[str, Any], where: str, step: int):
        self.state, self.where, self.step = state, where, step

    def __contains__(self, key: str) -> bool:
        return key in self.state

    def get(self, key: str, default: Any = None) -> Any:
        """The entry `key` as saved, unchecked (the reads below check it)."""
        return self.state.get(key, default)

    def refuse(self, key: str, what: str) -> UpcyclerError:
        """The one line refusing entry `key`: `what` is wrong with it, and the fix."""
        return UpcyclerError(f"{self.where}: meta {key} {what}; the checkpoint is damaged or was not written by "
                             "this run; resume from an earlier step (remove this one)")

    def count(self, value: Any, key: str, *, low: int = 0, high: int | None = None) -> int:
        """`value` as an integer in [low, high] (a bool or a float is not one)."""
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
            bound = f" from {low} to {high}" if high is not None else f" of at least {low}"
            raise self.refuse(key, f"is not an integer{bound}")
        return value

    def steps(self, value: Any, key: str, *, below: int) -> list[int]:
        """`value` as a non-empty list of steps, strictly ascending, each below `below`."""
        if not isinstance(value, list) or not value:
            raise self.refuse(key, "is not a non-empty list of steps")
        out = [self.count(v, key, high=below - 1) for v in value]
        if out != sorted(set(out)):
            raise self.refuse(key, "is not a list of steps in ascending order")
        return out

    def numbers(self, value: Any, key: str) -> list[float]:
        """`value` as a list of finite numbers (JSON's integers and floats; no bool)."""
        if not isinstance(value, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in value):
            raise self.refuse(key, "is not a list of finite numbers")
        return [float(x) for x in value]

    def array(self, value: Any, key: str, shape: tuple[int, ...], dims: str, *, counts: bool = False) -> np.ndarray:
        """`value` as an array of exactly `shape` (`dims` names its axes for the line): non-negative integers
        (int64) with `counts`, else finite numbers (float64)."""
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, OverflowError, RecursionError):
            arr = None
        kinds = "iu" if counts else "iuf"
        ok = arr is not None and arr.shape == tuple(shape) and arr.dtype.kind in kinds
        if ok:
            arr = arr.astype(np.int64 if counts else np.float64)
            ok = bool(np.isfinite(arr).all()) and not (counts and (arr < 0).any())
        if not ok:
            kind = "counts (integers ≥ 0)" if counts else "finite numbers"
            raise self.refuse(key, f"is not {kind} of shape [{dims}] = {list(shape)}")
        return arr


class Technique:
    """One technique on the loop: every hook is optional (a no-op here)."""

    meta_keys: ClassVar[tuple[str, ...]] = ()  # the checkpoint meta's entries `state` writes

    def before_step(self, ctx: StepContext) -> None:
        return None

    def start(self, ctx: StepContext) -> None:
        return None

    def after_step(self, ctx: StepContext) -> None:
        return None

    def before_write(self, ctx: StepContext) -> None:
        return None

    def after_write(self, ctx: StepContext) -> Action | None:
        return None

    def state(self) -> dict[str, Any]:
        """Its entries of the checkpoint's meta, keyed by `meta_keys` (plain JSON data)."""
        return {}

    def restore(self, meta: MetaEntries) -> None:
        """Take back the entries `state` saved (those an older checkpoint lacks are absent), each read
        through `meta`'s checks: a damaged entry is its one `UpcyclerError` line, naming the checkpoint."""

    def close(self) -> None:
        return None


def walk(techniques: Sequence[Technique], hook: str, ctx: StepContext) -> list[Action]:
    """Call the hook named `hook` of every technique, in order; the actions they asked for, in that order."""
    return [action for t in techniques if (action := getattr(t, hook)(ctx)) is not None]
