"""The progress display of a run (primary process only): a tqdm bar on an interactive terminal,
otherwise a plain line every `every` steps.

`Progress.update` composes one step's line from its metrics record: loss, learning rate, tokens per
second and, when there are, MFU, goodput and the expert-health summary of the window that ends there.
`note` prints a message between steps without breaking the bar.

What this module preserves: the display only reads the records, never changes them; `metrics.jsonl`
(`metrics_log`) stays the record of the run.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any


class Progress:
    """A tqdm bar on an interactive terminal; otherwise a plain line every `every` steps (primary only)."""

    def __init__(self, *, enabled: bool, start: int, total: int, every: int = 10):
        self.every = every
        self.enabled = enabled
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: Mapping[str, Any], experts: str = "") -> None:
        """Show one step's record; `experts` is the expert-health summary of its window, when it has one."""
        if not self.enabled:
            return
        summary = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s"
        if "mfu" in record:
            summary += f" mfu {100 * record['mfu']:.1f}%"
        if "goodput" in record:
            summary += f" goodput {100 * record['goodput']:.0f}%"
        if experts:
            summary += f" {experts}"
        if self._bar is not None:
            self._bar.set_postfix_str(summary, refresh=False)
            self._bar.update(1)
        elif record["step"] % self.every == 0:
            print(f"step {record['step']}: {summary}", flush=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
