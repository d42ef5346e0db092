"""Held-out evaluation as a technique on the loop (`eval` in the training config).

The evaluation itself (the held-out batches of each source, the compiled loss, when it is due) is the
run's (`upcycler.train.loop.heldout_eval.HeldoutEval`, which knows the mesh and the step); this technique
only says when it runs: compiled when the step is, the starting parameters measured before step 0 as
`eval_start/…`, and `eval/…` figures on the record of every step it is due after, never a discarded one's.
"""

from __future__ import annotations

from typing import Any, Protocol

from upcycler.train.techniques.protocol import StepContext, Technique


class Evaluator(Protocol):
    """What the technique asks of the run's held-out evaluation."""

    def compile(self, params: Any, mesh: Any, param_shardings: Any, step: int = 0) -> None: ...

    def baseline(self, params: Any, mesh: Any) -> dict[str, float]: ...

    def due(self, step: int) -> bool: ...

    def run(self, params: Any, mesh: Any, step: int = 0) -> dict[str, float]: ...


class HeldoutEvaluation(Technique):
    """An `Evaluator` on the loop: compiled with the step, the starting point measured before step 0, and
    the evaluation's figures on the record of every step it is due after (never a discarded one's)."""

    def __init__(self, heldout: Evaluator, mesh: Any, param_shardings: Any):
        self.heldout, self.mesh, self.param_shardings = heldout, mesh, param_shardings
        self._baseline: dict[str, float] = {}

    def start(self, ctx: StepContext) -> None:
        with ctx.clock.timed("program_startup"):
            self.heldout.compile(ctx.params, self.mesh, self.param_shardings, ctx.step)
        if ctx.step == 0:  # the starting point of every eval curve
            with ctx.clock.timed("eval"):
                self._baseline = self.heldout.baseline(ctx.params, self.mesh)

    def before_write(self, ctx: StepContext) -> None:
        if ctx.step == 0:
            ctx.record.update(self._baseline)
        if ctx.discarded is None and self.heldout.due(ctx.step):
            with ctx.clock.timed("program_startup"):  # a shape not evaluated before: compiled now
                self.heldout.compile(ctx.params, self.mesh, self.param_shardings, ctx.step)
            with ctx.clock.timed("eval"):
                ctx.record.update(self.heldout.run(ctx.params, self.mesh, ctx.step))
