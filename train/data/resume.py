"""What an interrupted `prepare-data` left in its work directory, and how the same command run again
finishes it (`prepare` drives this; the layout of the work directory is `shard_writer`'s).

- **Units** (`unit_states`, before the engine runs): a unit whose record and shard are whole is reused and
  not sent to the engine at all; any other is tokenised, and the summary says why (`redone_reasons`): it
  had not started, it was interrupted before its first checkpoint, it goes on from its checkpoints (the
  finished steps are kept, see `plan.unit_steps`), its shard was missing or damaged (its record is
  dropped), or it failed in the earlier run.
- **Publishing** (`write_journal` / `read_journal`): when every unit is done, the indexes are written to
  the work directory's journal before anything moves into OUT. A rerun that finds the journal of its own
  plan (the same inputs and options: the work directory is named by the plan's key) knows that the
  outputs of those names in OUT are its own, kept or half-published: it finishes publishing them instead
  of refusing them as existing outputs. Another command finds no journal of its plan, and is refused.
  The journal names its plan (the key) and lists its sources: one that names another plan or other
  sources, or lacks a field the publishing and the summary read, is refused in one line, never trusted.
- **Removal** (`discard`): the journal is removed last, so a kill while the work directory goes still
  leaves a rerun that knows the output is its own.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.train.data.format import token_dtype
from upcycler.train.data.plan import Plan, Unit, piece_bytes, unit_steps
from upcycler.train.data.shard_writer import (
    DIGESTS,
    RECORDS,
    STEPS,
    finished_step,
    partial_dir,
    read_record,
    shard_intact,
    shard_paths,
    steps_dir,
)
from upcycler.units import human_bytes
from upcycler.untrusted import describe, shown_path

JOURNAL = "publishing.json"  # the indexes of a preparation whose every unit is done, being published
LOCK = ".lock"
REUSED = "reused"
NOT_STARTED = "not started"
BEFORE_CHECKPOINT = "interrupted before a checkpoint"
FROM_CHECKPOINT = "interrupted, continued from a checkpoint"
DAMAGED = "shard missing or damaged"
FAILED = "failed in the earlier run"


@dataclass(frozen=True)
class UnitState:
    """What a rerun does with a unit: `reason` is REUSED, or why the unit is tokenised; `kept_bytes` are the
    input bytes of its finished steps (the work it continues from)."""

    reason: str
    kept_bytes: int = 0


def _started(work: Path) -> bool:
    """Whether an earlier run of this plan left anything in `work` (beside the lock)."""
    try:
        return any(entry.name != LOCK for entry in os.scandir(work))
    except OSError:
        return False


def unit_states(plan: Plan, work: Path) -> dict[Unit, UnitState]:
    """Each unit's state in `work`, as an earlier run of the plan left it; the record of a unit whose shard
    is not whole is removed, so that the unit is tokenised again."""
    if not _started(work):
        return {unit: UnitState(NOT_STARTED) for unit in plan.units}
    return {unit: _state(plan, work, unit) for unit in plan.units}


def _state(plan: Plan, work: Path, unit: Unit) -> UnitState:
    """The state of `unit` in `work` (see `unit_states`)."""
    _, record_path, error_path = shard_paths(work, unit)
    try:
        record = read_record(work, unit)
    except (OSError, ValueError):
        record = {}
    if record is not None:
        if record and shard_intact(work, record, token_dtype(plan.settings.vocab_size)):
            return UnitState(REUSED)
        record_path.unlink(missing_ok=True)
        return UnitState(DAMAGED)
    if error_path.exists():
        return UnitState(FAILED)
    kept = _finished_steps_bytes(plan, work, unit)
    if kept:
        return UnitState(FROM_CHECKPOINT, kept)
    partial = partial_dir(work, unit)
    return UnitState(BEFORE_CHECKPOINT if partial.is_dir() and any(partial.iterdir()) else NOT_STARTED)


def _finished_steps_bytes(plan: Plan, work: Path, unit: Unit) -> int:
    """The input bytes of the unit's finished steps in `work` (0 when none)."""
    if not steps_dir(work, unit).is_dir():
        return 0
    files = plan.files[unit.source]
    steps = enumerate(unit_steps(unit, files, plan.settings.step_bytes))
    return sum(piece_bytes(piece, files) for number, pieces in steps
               if finished_step(work, unit, number, pieces, plan.settings) for piece in pieces)


def redone_reasons(states: Iterable[UnitState]) -> list[str]:
    """Why the units of `states` that are not reused are tokenised, counted by reason: e.g. `4 not started`,
    `2 interrupted, continued from a checkpoint (1.05 MB of their input done)`."""
    redone = [state for state in states if state.reason != REUSED]
    reasons = []
    for reason in (NOT_STARTED, BEFORE_CHECKPOINT, FROM_CHECKPOINT, DAMAGED, FAILED):
        matching = [state for state in redone if state.reason == reason]
        if matching:
            kept = sum(state.kept_bytes for state in matching)
            done = f" ({human_bytes(kept)} of their input done)" if kept else ""
            reasons.append(f"{len(matching)} {reason}{done}")
    return reasons


def write_journal(work: Path, plan: Plan, indexes: Sequence[Mapping]) -> None:
    """Record that every unit of `plan` is done and `indexes` are to be published (atomically: whole or
    absent); the journal names its plan (`plan.key`), so no other plan's journal is ever taken for it."""
    partial = work / f".{JOURNAL}.{os.getpid()}"
    partial.write_text(json.dumps({"plan": plan.key, "indexes": list(indexes)}), encoding="utf-8")
    os.replace(partial, work / JOURNAL)


# what the summary and the publishing read of each index in the journal, and the type each must have
_JOURNAL_FIELDS = {"name": str, "dtype": str, "num_documents": int, "num_tokens": int, "files": list,
                   "shards": list, "shards_tokenised": int, "shards_reused": int}


def read_journal(work: Path, plan: Plan, names: Sequence[str]) -> list[dict] | None:
    """The indexes an earlier run of `plan` was publishing from `work` (the sources `names`, in order), or
    None when there is no journal. A journal of another plan, of other sources, or missing a field is
    never trusted: one `UpcyclerError` line naming the journal, the field and the fix."""
    path = work / JOURNAL
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # no journal (or no work directory: its place is a file)
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise _untrusted(path, f"cannot be read ({getattr(err, 'strerror', None) or type(err).__name__})") from None
    try:
        journal = json.loads(text)
    except ValueError:
        raise _untrusted(path, "is not JSON") from None
    if not isinstance(journal, dict) or not isinstance(journal.get("indexes"), list):
        raise _untrusted(path, "has no list of `indexes`")
    if journal.get("plan") != plan.key:
        raise _untrusted(path, f"names plan {_shown(journal.get('plan'))}, not this preparation's {plan.key}")
    indexes = journal["indexes"]
    for i, index in enumerate(indexes):
        if not isinstance(index, dict):
            raise _untrusted(path, f"indexes[{i}] is not an object")
        for field, kind in _JOURNAL_FIELDS.items():
            value = index.get(field)
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
                wanted = "a count" if kind is int else f"a {kind.__name__}"
                raise _untrusted(path, f"indexes[{i}].{field} is {'missing' if field not in index else 'not ' + wanted}")
    listed = [index["name"] for index in indexes]
    if listed != list(names):
        raise _untrusted(path, f"lists sources {_shown(listed)}, not this preparation's {_shown(list(names))}")
    return indexes


def _untrusted(path: Path, problem: str) -> UpcyclerError:
    """The one line refusing the publish journal `path`: what is wrong, and the fix."""
    return UpcyclerError(f"{shown_path(path)}: {problem}; this publish journal is not this preparation's, so "
                         "nothing of it is trusted; remove it and run the same command again")


def _shown(value: object) -> str:
    """`value` (a plan key, or a list of source names) as a bounded part of a line."""
    if isinstance(value, list):
        more = f", … ({len(value)} in all)" if len(value) > 8 else ""
        return "[" + ", ".join(describe(v, 40) for v in value[:8]) + more + "]"
    return describe(value, 40)


def discard(work: Path) -> None:
    """Remove the work directory `work`, its journal last."""
    try:
        entries = list(os.scandir(work))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name == JOURNAL:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            Path(entry.path).unlink(missing_ok=True)
    (work / JOURNAL).unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)


def holds_progress(work: Path) -> bool:
    """Whether `work` holds anything a rerun could reuse: the journal, a unit's record, a step or a file's
    digest."""
    return (work / JOURNAL).exists() or any(any(p.is_file() for p in (work / folder).rglob("*.json"))
                                            for folder in (RECORDS, STEPS, DIGESTS) if (work / folder).is_dir())
