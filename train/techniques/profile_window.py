"""The `profile` section: a `jax.profiler` trace of steps [start_step, start_step + steps).

Every process traces its own host into RUN_DIR/tensorboard/plugins/profile/<session>/<host>.xplane.pb,
the layout TensorBoard's profile tab (XProf, `tensorboard-plugin-profile`) lists as one session beside the
scalars. For a bucket run_dir the trace is written into the local mirror (`writers.local_mirror`) and
uploaded when it stops. A resumed run traces only what of the window is still ahead of it.
`ProfileWindow` is a technique on the loop (`upcycler.train.techniques.protocol`); the run tells it where
the trace goes (`reporting.writers.trace_location`: the directory, and how to upload it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax

from upcycler.train.config import ProfileConfig
from upcycler.train.techniques.protocol import StepContext, Technique


class ProfileWindow(Technique):
    """Starts the trace before the window's first step and stops it after its last (see the module docstring)."""

    def __init__(self, options: ProfileConfig | None, logdir: Path, upload: Callable[[], None] | None = None):
        self.options, self.logdir, self.upload = options, logdir, upload
        self._active = False

    def before_step(self, ctx: StepContext) -> None:
        o = self.options
        if o is not None and not self._active and o.start_step <= ctx.step < o.start_step + o.steps:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir))
            self._active = True

    def after_step(self, ctx: StepContext) -> None:
        o = self.options
        if self._active and (o is None or ctx.step + 1 >= o.start_step + o.steps):
            self.close()

    def close(self) -> None:
        """End the trace (if one is running) and upload it where the run says so."""
        if not self._active:
            return
        jax.profiler.stop_trace()
        self._active = False
        if self.upload is not None:
            self.upload()
