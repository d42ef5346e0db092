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
                        for the loop: `SAVE` this step, `STOP` (save it and end the run: preempted), or
                        `Rewind` to the average of earlier checkpoints
    close()             the run ends, however it ends (in the reverse order of the list)

Techniques are called in the order of the list, each hook in turn, so a later technique sees what an
earlier one recorded (`ctx.discarded`). What a technique carries across a checkpoint is `state()`: its
entries of the checkpoint's meta, under the keys it declares in `meta_keys` (no two techniques share
one); a resumed run gives each technique back its entries (`restore`), and a technique restores an
entry missing from an older checkpoint to its start. `upcycler.train.loop.checkpointing` owns the meta.

This module imports nothing of the loop: a technique is read and tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol


class Checkpoints(Protocol):
    """What a technique may ask of the run's checkpoints: the committed steps and their directories."""

    def committed(self) -> list[int]: ...

    def step_dir(self, step: int) -> Path: ...


@dataclass(frozen=True)
class Action:
    """What a technique asks of the loop after a step: `SAVE` it, or `STOP` (save it, end the run)."""

    kind: str


SAVE = Action("save")
STOP = Action("stop")


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

    def restore(self, state: Mapping[str, Any], where: str) -> None:
        """Take back the entries `state` saved (those an older checkpoint lacks are absent); a damaged
        entry is an `UpcyclerError` naming `where`, the checkpoint."""

    def close(self) -> None:
        return None


def walk(techniques: Sequence[Technique], hook: str, ctx: StepContext) -> list[Action]:
    """Call the hook named `hook` of every technique, in order; the actions they asked for, in that order."""
    return [action for t in techniques if (action := getattr(t, hook)(ctx)) is not None]
