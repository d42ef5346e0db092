"""A resumed run's metrics log cut back to its start step, so that the log always describes one
uninterrupted trajectory.

A resumed run first drops the records of steps at or after its start step (they were not checkpointed):
`truncate_file` from a local `metrics.jsonl`, `truncate_objects` from a bucket run_dir's metrics objects
(`metrics_objects`). Both return the last record kept and the last record there was (checked by
`metrics.parse_metrics_line`), for the goodput clock. The local log is read backwards from its end, only
as far as the last line it keeps, and cut there in place (a resume costs the same after 10 or 100,000
steps); a log whose lines do not all start as the trainer writes them is read whole (`read_metrics`) and
rewritten atomically with its checked records.

What this module preserves: every complete record before the start step (byte for byte when the lines
are as the trainer wrote them), none at or after it; a torn last line (a run killed mid-write) is
dropped; no line longer than `MAX_JSON_BYTES` is read whole.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from upcycler.errors import UpcyclerError
from upcycler.train.reporting import metrics_objects
from upcycler.train.reporting.metrics import parse_metrics_line, read_metrics
from upcycler.untrusted import MAX_JSON_BYTES, open_regular, shown_path

_FIX = "fix or delete that line"
_STEP_PREFIX = re.compile(rb'^\{"step": (\d+)[,}]')
_TAIL_BLOCK = 1 << 20


def truncate_file(path: Path, start_step: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Keep only the complete records of steps before `start_step`; returns (the last record kept, the
    last complete record there was), each None when there is none (and both None for step 0: a new run).

    The log is read backwards from its end, as far as the last line kept, and cut there in place. A log
    whose lines do not all start as the trainer writes them (`{"step": N`) is read whole and rewritten
    atomically with its checked records instead."""
    if not os.path.lexists(path):
        return None, None
    os.close(open_regular(path, "metrics log"))  # a regular file, or one clear line
    last: dict[str, Any] | None = None
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if start_step == 0:
            f.truncate(0)
            return None, None
        for offset, line in _lines_backwards(f, size, path):
            if not line.endswith(b"\n"):
                continue  # only the last line can lack its line break: torn by a run killed mid-write
            match = _STEP_PREFIX.match(line)
            if match is None:
                if not line.strip():
                    continue
                break
            step = int(match.group(1))
            record = None
            if last is None or step < start_step:
                record = parse_metrics_line(line, f"{shown_path(path)}: the line at byte {offset}")
            if last is None:
                last = record
            if step < start_step:
                f.truncate(offset + len(line))
                return record, last
        else:
            f.truncate(0)
            return None, last
    kept = [r for r in read_metrics(path.parent) if r["step"] < start_step]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return (kept[-1] if kept else None), last


def truncate_objects(run_dir: Path, start_step: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """`truncate_file` for the metrics objects of a bucket run_dir (`metrics_objects`): (the last record
    kept, the last record there was), read before the objects at or after `start_step` are removed."""
    kept_last = _parsed(metrics_objects.tail(run_dir, start_step), run_dir)
    metrics_objects.truncate_from(run_dir, start_step)
    return kept_last


def _lines_backwards(f: BinaryIO, size: int, path: Path) -> Iterator[tuple[int, bytes]]:
    """(offset, line with its line break if it has one) of every line of `f`, last first, read in blocks
    from the end; a line longer than `MAX_JSON_BYTES` is refused."""
    pos, tail, tail_ends = size, b"", False  # tail: the earliest, maybe partial, line read so far
    while pos > 0:
        n = min(_TAIL_BLOCK, pos)
        pos -= n
        f.seek(pos)
        pieces = (f.read(n) + tail).split(b"\n")
        offset, found = pos + len(pieces[0]) + 1, []
        for k, piece in enumerate(pieces[1:], start=1):
            ends = k < len(pieces) - 1 or tail_ends
            if piece or ends:
                found.append((offset, piece + b"\n" if ends else piece))
            offset += len(piece) + 1
        yield from reversed(found)
        tail, tail_ends = pieces[0], len(pieces) > 1 or tail_ends
        if len(tail) > MAX_JSON_BYTES:
            raise UpcyclerError(f"{shown_path(path)}: a line longer than {MAX_JSON_BYTES:,} bytes; not a metrics "
                                f"log the trainer wrote; {_FIX}")
    if tail or tail_ends:
        yield 0, tail + b"\n" if tail_ends else tail


def _parsed(lines: tuple[bytes | None, bytes | None], run_dir: Path) -> tuple[dict | None, dict | None]:
    """The records of (kept, last) lines of a bucket run_dir's metrics objects."""
    where = f"{shown_path(run_dir)}/{metrics_objects.PREFIX}*.jsonl"
    return tuple(None if line is None else parse_metrics_line(line, where) for line in lines)  # type: ignore[return-value]
