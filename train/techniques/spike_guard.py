"""The loss-spike guard (`loss.spike`): notice a step whose loss jumps, then stop or rewind.

A step's loss is a spike when it is not finite, or above `factor` × the median loss of the `window`
previous good steps (the guard waits until it has seen `window` of them). The spiking step's state is
never saved. Then:

- `stop`: the run ends with one line naming the step, the losses, and the last good checkpoints.
- `rewind`: the weights become the average (sma) of the last `average` good checkpoints, the optimiser
  state (its update count set to the current step, so the learning-rate schedule goes on) and the
  weights' moving average those of the newest of them; the step counter and the data go on from the
  spiking step (its batch is skipped, not replayed), checkpoints saved from the spiked
  state are deleted, and the rewound state is saved at once, so a resumed run continues bit for bit.

Good checkpoints are those of states before the spiking step: checkpoint N holds the state that
computed step N's loss, so the checkpoint of the spiking step itself is not good.
The spike is recorded in `metrics.jsonl` (`spike` on the step's record) and every later checkpoint's
lineage (`rewinds`). The window is saved with every checkpoint (`meta/`, `spike_window`) and restored with it, so a
resumed run decides exactly as it would have without the interruption, on every process.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.config import SpikeConfig
from upcycler.train.techniques.protocol import Action, MetaEntries, Rewind, StepContext, Technique


class SpikeGuard(Technique):
    """The window of recent good losses, the verdict on each new one, and the rewinds so far (a technique:
    `upcycler.train.techniques.protocol`). Without a config (`loss.spike` absent) it judges nothing, and
    still carries the rewinds a checkpoint recorded."""

    meta_keys = ("rewinds", "spike_window")

    def __init__(self, config: SpikeConfig | None, recent: Sequence[float] = ()):
        """`recent`: the window a checkpoint saved (`meta/spike_window`), oldest first."""
        self.config = config
        self.recent: deque[float] = deque((float(x) for x in recent), maxlen=config.window if config else 0)
        self.rewinds: list[dict[str, Any]] = []
        self._spike: tuple[str, list[int], list[int]] | None = None  # what, good and chosen checkpoints

    def median(self) -> float | None:
        """The median of the window, or None while it holds fewer than `window` losses."""
        assert self.config is not None
        if len(self.recent) < self.config.window:
            return None
        return float(np.median(np.asarray(self.recent, np.float64)))

    def is_spike(self, loss: float) -> bool:
        """Whether `loss` is a spike; a good loss joins the window."""
        median = self.median()
        if not math.isfinite(loss) or (median is not None and loss > self.config.factor * median):
            return True
        self.recent.append(loss)
        return False

    def describe(self, step: int, loss: float) -> str:
        assert self.config is not None
        median = self.median()
        if median is None or not math.isfinite(loss):
            return f"loss {loss} at step {step}"
        return (f"loss {loss:.4g} at step {step} is {loss / median:.1f}× the median {median:.4g} of the last "
                f"{self.config.window} steps (loss.spike.factor {self.config.factor:g})")

    def after_step(self, ctx: StepContext) -> None:
        """Judge the step's loss; a spike discards the step, its record naming the checkpoints a rewind
        would average (the good ones: before the spiking step)."""
        self._spike = None
        if self.config is None or not self.is_spike(float(ctx.raw["loss"])):
            return
        assert ctx.checkpoints is not None
        loss = ctx.record["loss"]
        what = self.describe(ctx.step, float(loss) if loss is not None else float("nan"))
        good = [n for n in ctx.checkpoints.committed() if n < ctx.step]
        chosen = good[-self.config.average:]
        self._spike = (what, good, chosen)
        ctx.discard({"spike": {"action": self.config.action, "median": self.median(), "averaged": chosen}})

    def after_write(self, ctx: StepContext) -> Action | None:
        """After a spike: stop (naming the good checkpoints), or rewind to the average of the chosen ones."""
        if self._spike is None:
            return None
        assert self.config is not None and ctx.checkpoints is not None
        (what, good, chosen), self._spike = self._spike, None
        if self.config.action == "stop" or not good:
            names = ", ".join(str(ctx.checkpoints.step_dir(n)) for n in chosen) or "none (no checkpoint before it)"
            later = [n for n in ctx.checkpoints.committed() if n >= ctx.step]
            caveat = (f"; checkpoint(s) {', '.join(map(str, later))} hold the spiked state: delete them before "
                      "resuming" if later else "")
            why = "" if good else "; there is no good checkpoint to rewind to"
            raise UpcyclerError(f"loss spike: {what}; stopped without saving it{why}; the last good checkpoints "
                                f"are {names}{caveat}; lower optimizer.lr or check the data")
        self.rewinds.append({"step": ctx.step, "averaged": chosen})
        return Rewind(to=tuple(chosen),
                      why=f"loss spike: {what}; rewound to the average of steps {', '.join(map(str, chosen))}")

    def state(self) -> dict[str, Any]:
        return {"rewinds": self.rewinds, "spike_window": list(self.recent) if self.config is not None else []}

    def restore(self, meta: MetaEntries) -> None:
        """The rewinds and the window a checkpoint saved, checked: a damaged one is refused in one line."""
        self.rewinds = _rewinds(meta)
        if self.config is not None:
            self.recent = deque(meta.numbers(meta.get("spike_window", []), "spike_window"), maxlen=self.config.window)


def _rewinds(meta: MetaEntries) -> list[dict[str, Any]]:
    """The lineage's rewinds a checkpoint saved: each `{"step": N, "averaged": [steps before N]}`, the steps
    ascending and before the checkpoint's own (so nothing else is carried into the next checkpoint)."""
    value = meta.get("rewinds", [])
    if not isinstance(value, list):
        raise meta.refuse("rewinds", "is not a list of rewinds")
    out: list[dict[str, Any]] = []
    for i, rewind in enumerate(value):
        key = f"rewinds[{i}]"
        if not isinstance(rewind, dict) or set(rewind) != {"step", "averaged"}:
            raise meta.refuse(key, 'is not a rewind {"step": N, "averaged": [steps before N]}')
        low = out[-1]["step"] + 1 if out else 0
        step = meta.count(rewind["step"], f"{key}.step", low=low, high=meta.step - 1)
        out.append({"step": step, "averaged": meta.steps(rewind["averaged"], f"{key}.averaged", below=step)})
    return out
