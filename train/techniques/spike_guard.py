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

import numpy as np

from upcycler.train.config import SpikeConfig


class SpikeGuard:
    """The window of recent good losses, and the verdict on each new one."""

    def __init__(self, config: SpikeConfig, recent: Sequence[float] = ()):
        """`recent`: the window a checkpoint saved (`meta/spike_window`), oldest first."""
        self.config = config
        self.recent: deque[float] = deque((float(x) for x in recent), maxlen=config.window)

    def median(self) -> float | None:
        """The median of the window, or None while it holds fewer than `window` losses."""
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
        median = self.median()
        if median is None or not math.isfinite(loss):
            return f"loss {loss} at step {step}"
        return (f"loss {loss:.4g} at step {step} is {loss / median:.1f}× the median {median:.4g} of the last "
                f"{self.config.window} steps (loss.spike.factor {self.config.factor:g})")
