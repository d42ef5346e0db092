"""SIGTERM ends a command the way Ctrl-C does: its clean-up runs, one line is printed, the exit is non-zero.

A scheduler (Kubernetes, Slurm, systemd, a CI runner) stops a job with SIGTERM, whose default action ends
the process on the spot: no clean-up runs, a hidden `.OUT.partial-*` stays behind and nothing says why.
While a command runs (`terminating_like_interrupts`), SIGTERM raises `Terminated`, a `KeyboardInterrupt`,
in the main thread, so everything that an interrupt cleans up (staging directories, locks, a bucket
upload's local copy) is cleaned up, and what an interrupt keeps for a rerun (prepare-data's work
directory) is kept, and said so (`kept_for_rerun`); the CLI then prints one line and exits with
`TERMINATED_EXIT_STATUS`. A further
SIGTERM during that clean-up is ignored, so the clean-up finishes.

Training replaces this handler with its own while its loop runs (SIGTERM there is a preemption: the step
is saved and the run exits with its own status) and puts this one back after it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

TERMINATED_EXIT_STATUS = 128 + signal.SIGTERM
"""The exit status of a command ended by SIGTERM, as a shell reports a process the signal killed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a command ran."""


@contextmanager
def kept_for_rerun(note: str) -> Iterator[None]:
    """An interrupt (Ctrl-C or SIGTERM) that leaves the block carries `note`, what the command keeps for a
    rerun, for its one line (`interrupt_line`)."""
    try:
        yield
    except KeyboardInterrupt as err:
        err.kept_for_rerun = note  # type: ignore[attr-defined]
        raise


def interrupt_line(err: BaseException | None) -> str:
    """The one line for the interrupt `err` (a `KeyboardInterrupt`, `Terminated` included)."""
    how = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
    note = getattr(err, "kept_for_rerun", None)
    return f"{how}; no output was finished" + (f"; {note}" if note else "")


@contextmanager
def terminating_like_interrupts() -> Iterator[None]:
    """For the block, SIGTERM raises `Terminated` (once); the previous handler is restored after it. Outside
    the main thread (where no handler can be set) the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard = []

    def handle(signum, frame) -> None:
        if not heard:  # the first one only: the clean-up it starts is not cut short by another
            heard.append(signum)
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
