"""The checkpoint schedule (`checkpoint.every`): which steps are saved.

A step is saved when the number of steps done is a multiple of `every`, and after the run's last step;
a discarded step never is (the loss-spike guard saves the state it rewinds to itself). A preemption
saves the step it stops at whatever the schedule says (`preemption`).
"""

from __future__ import annotations

from upcycler.train.techniques.protocol import SAVE, Action, StepContext, Technique


class CheckpointSchedule(Technique):
    """Asks the loop to save after every `every`-th step and after the last of `steps`."""

    def __init__(self, every: int, steps: int):
        self.every, self.steps = every, steps

    def after_write(self, ctx: StepContext) -> Action | None:
        done = ctx.step + 1
        if ctx.discarded is None and (done % self.every == 0 or done == self.steps):
            return SAVE
        return None
