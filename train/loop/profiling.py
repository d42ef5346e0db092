"""The `profile` section: a `jax.profiler` trace of steps [start_step, start_step + steps).

Every process traces its own host into RUN_DIR/tensorboard/plugins/profile/<session>/<host>.xplane.pb,
the layout TensorBoard's profile tab (XProf, `tensorboard-plugin-profile`) lists as one session beside the
scalars. For a bucket run_dir the trace is written into the local mirror (`writers.local_mirror`) and
uploaded when it stops. A resumed run traces only what of the window is still ahead of it.
`ProfileWindow` is a technique on the loop (`upcycler.train.techniques.protocol`).
"""

from __future__ import annotations

from pathlib import Path

import jax

from upcycler.locations import is_remote
from upcycler.train.config import ProfileConfig
from upcycler.train.reporting.writers import TENSORBOARD_DIR, local_mirror, upload_tree
from upcycler.train.techniques.protocol import StepContext, Technique


class ProfileWindow(Technique):
    """Starts the trace before the window's first step and stops it after its last (see the module docstring)."""

    def __init__(self, options: ProfileConfig | None, run_dir: Path):
        self.options, self.run_dir = options, run_dir
        remote = is_remote(run_dir)
        self.logdir = (local_mirror(run_dir) if remote else Path(run_dir)) / TENSORBOARD_DIR
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
        """End the trace (if one is running) and, for a bucket run_dir, upload it."""
        if not self._active:
            return
        jax.profiler.stop_trace()
        self._active = False
        if is_remote(self.run_dir):
            upload_tree(self.logdir, self.run_dir / TENSORBOARD_DIR)
