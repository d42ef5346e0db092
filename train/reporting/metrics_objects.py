"""The metrics log of a run whose run_dir is a bucket: objects written whole, never appended.

An object store cannot append, so the primary process keeps the records since the last checkpoint in
memory and writes them as one object when a checkpoint is saved (and at the end of the run):

    RUN_DIR/metrics-<first step, 10 digits>-<last step, 10 digits>.jsonl

(objects at the top level: Orbax takes any directory of a bucket run_dir without its commit file for an
unfinished checkpoint and deletes it when the next run starts).

The objects, in name order, concatenate to exactly the `metrics.jsonl` a local run_dir would hold: the
same lines, the same bytes. A resumed run first removes what lies at or after its start step (objects
entirely after it are deleted; one that straddles it is rewritten with the earlier lines under its new
name, then the old one deleted), as the local log is truncated.

What this module preserves: the lines, byte for byte, in step order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

PREFIX = "metrics-"
_NAME = re.compile(r"^metrics-(\d{10})-(\d{10})\.jsonl$")


def _intervals(run_dir: Path) -> list[tuple[int, int, Path]]:
    """(first step, last step, path) of every metrics object, in step order."""
    if not run_dir.exists():
        return []
    found = []
    for path in run_dir.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), int(match.group(2)), path))
    return sorted(found)


def write_interval(run_dir: Path, steps: Sequence[int], lines: Sequence[str]) -> None:
    """Write `lines` (the records of `steps`, each ending in a line break) as one object."""
    if lines:
        (run_dir / f"{PREFIX}{steps[0]:010d}-{steps[-1]:010d}.jsonl").write_text("".join(lines), encoding="utf-8")


def truncate_from(run_dir: Path, start_step: int) -> None:
    """Remove the records of steps at or after `start_step`."""
    for first, last, path in _intervals(run_dir):
        if first >= start_step:
            path.unlink()
        elif last >= start_step:
            kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                    if _step_of(line) < start_step]
            write_interval(run_dir, [first, start_step - 1], kept)
            path.unlink()


def tail(run_dir: Path, start_step: int) -> tuple[bytes | None, bytes | None]:
    """(the last line of a step before `start_step`, the last line of all), each None when there is
    none; reads at most the two objects that hold them."""
    intervals = _intervals(run_dir)
    if not intervals or start_step == 0:
        return None, None
    last_lines = intervals[-1][2].read_bytes().splitlines(keepends=True)
    kept = None
    for first, _, path in reversed(intervals):
        if first < start_step:
            lines = last_lines if path == intervals[-1][2] else path.read_bytes().splitlines(keepends=True)
            kept = next((line for line in reversed(lines) if _step_of(line.decode("utf-8", "replace"))
                         in range(start_step)), None)
            break
    return kept, (last_lines[-1] if last_lines else None)


def read_all(run_dir: Path) -> bytes | None:
    """The concatenated bytes of every metrics object in step order, or None when there is none."""
    intervals = _intervals(run_dir)
    if not intervals:
        return None
    return b"".join(path.read_bytes() for _, _, path in intervals)


def _step_of(line: str) -> int:
    match = re.match(r'\{"step": (\d+)', line)
    return int(match.group(1)) if match else -1
