"""The progress display of a run (primary process only): a tqdm bar on an interactive terminal,
otherwise a plain line every `every` steps.

`Progress.update` composes one step's line from its metrics record: loss, learning rate, tokens per
second and, when there are, MFU, goodput and the expert-health summary of the window that ends there.
`note` prints a message between steps without breaking the bar. While requests to Cloud Storage wait to
be tried again (`bucket_client.storage_retrying`), the step's line says so, and a watcher says it between
steps too (every `RETRY_NOTE_EVERY` seconds while it lasts), since a run waiting on its bucket (a
checkpoint's save, a batch's tokens) shows no new step.

What this module preserves: the display only reads the records, never changes them; `metrics.jsonl`
(`metrics_log`) stays the record of the run.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from typing import Any

from upcycler.bucket_client import storage_retrying

RETRY_NOTE_EVERY = 10.0  # seconds between the watcher's notes while storage is being retried


class Progress:
    """A tqdm bar on an interactive terminal; otherwise a plain line every `every` steps (primary only)."""

    def __init__(self, *, enabled: bool, start: int, total: int, every: int = 10,
                 retry_note_every: float = RETRY_NOTE_EVERY):
        self.every = every
        self.enabled = enabled
        self._bar = None
        self._closed = threading.Event()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        if enabled:
            threading.Thread(target=self._watch_storage, args=(retry_note_every,), daemon=True,
                             name="storage-retry-notes").start()

    def _watch_storage(self, every: float) -> None:
        """Note a retrying storage every `every` seconds while it lasts, until `close`."""
        while not self._closed.wait(every):
            retrying = storage_retrying()
            if retrying:
                self.note(retrying)

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
        if retrying := storage_retrying():
            summary += f" ({retrying})"
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
        self._closed.set()
        if self._bar is not None:
            self._bar.close()
