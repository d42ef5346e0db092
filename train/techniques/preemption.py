"""Preemption: SIGTERM on any process stops every process after one same step, which is saved.

`Preemption.after_write` asks, after each step with the same step numbers on every process, whether to
stop; the answer turns yes on all of them at one step, and the loop saves that step and returns
`RunResult(preempted=True)`.

Several processes: JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`): the
process that got SIGTERM (JAX's own handler, installed by `jax.distributed.initialize`) tells the
coordination service, which picks the first step every process can still reach; no collective runs per
step. One process: a SIGTERM handler of our own, installed when the technique is made (as the loop
starts) and put back by `close`.
"""

from __future__ import annotations

import signal

import jax

from upcycler.train.techniques.protocol import STOP, Action, StepContext, Technique


class Preemption(Technique):
    """Stops (and saves) every process after the same step once any of them got SIGTERM."""

    def __init__(self):
        self.hit = False
        self._shared = jax.process_count() > 1
        self._previous = None if self._shared else signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.hit = True

    def agreed(self, step: int) -> bool:
        """Whether every process stops once `step` steps are done."""
        if not self._shared:
            return self.hit
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(step))

    def after_write(self, ctx: StepContext) -> Action | None:
        return STOP if self.agreed(ctx.step + 1) else None

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
