"""Find the checkpoints to merge: checkpoint directories as given, and steps picked from training runs.

A *run directory* is a directory that is not itself a checkpoint but has step sub-directories, named
by step number the way Orbax's CheckpointManager names them (`1000/`) or `step_1000/` (also
`checkpoint-1000/`, the Hugging Face Trainer's name). Anything else in it (Orbax's `*.orbax-checkpoint-tmp-*`
directories of an unfinished save, logs) is ignored. The checkpoint of a step is the step directory
itself if it is readable (`upcycler.io.checkpoint.detect_format`), else its first readable
sub-directory, `params/` first and then by name (CheckpointManager keeps each item in a sub-directory).

Steps are chosen in this order: drop steps after `until`; keep steps divisible by `every`; keep the
`last` highest. They are returned oldest first, so "newest weighs most" methods (ema, wma) weigh the
latest step most.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.io import detect_format
from upcycler.untrusted import shown_path

STEP_DIR = re.compile(r"(?:step_|checkpoint-)?(\d+)")


def find_checkpoints(
    paths: Sequence[str | Path], *, last: int | None = None, every: int | None = None, until: int | None = None,
) -> list[tuple[Path, int | None]]:
    """(checkpoint directory, step or None) for every input, run directories expanded oldest first; the same
    checkpoint (symlinks resolved) named twice, or in a run named twice, is refused: it would count double."""
    for flag, value in (("--last", last), ("--every", every)):
        if value is not None and value < 1:
            raise UpcyclerError(f"{flag} {value} must be at least 1")
    out: list[tuple[Path, int | None]] = []
    runs = 0
    for path in map(Path, paths):
        if is_checkpoint(path):
            out.append((path, None))
            continue
        if not path.is_dir():
            detect_format(path)  # raises the reader's message: missing, or not a directory
        steps = step_dirs(path)
        if not steps:
            raise UpcyclerError(
                f"{path}: not a checkpoint (no config.json, or params/ + upcycler.json) and not a run directory "
                "(no step sub-directories like 1000/ or step_1000/); point at a checkpoint or a run"
            )
        runs += 1
        out += [(checkpoint_in(d), s) for s, d in select_steps(path, steps, last=last, every=every, until=until)]
    if runs == 0 and (last, every, until) != (None, None, None):
        raise UpcyclerError("--last, --every and --until pick steps of a run directory, but no input is one")
    _refuse_twice([path for path, _ in out])
    return out


def _refuse_twice(checkpoints: list[Path]) -> None:
    seen: dict[Path, Path] = {}
    for path in checkpoints:
        real = path.resolve()
        if real in seen:
            raise UpcyclerError(f"{shown_path(path)}: merged twice (also as {shown_path(seen[real])}); name each "
                                "checkpoint or run once (weights say how much one counts)")
        seen[real] = path


def is_checkpoint(path: Path) -> bool:
    try:
        detect_format(path)
    except UpcyclerError:
        return False
    return True


def step_dirs(run: Path) -> dict[int, Path]:
    """Step number → step directory, for the sub-directories of `run` named like steps."""
    found: dict[int, Path] = {}
    for child in sorted(run.iterdir()):
        match = STEP_DIR.fullmatch(child.name)
        if match and child.is_dir():
            step = int(match.group(1))
            if step in found:
                raise UpcyclerError(f"{run}: step {step} is both {found[step].name}/ and {child.name}/; remove one")
            found[step] = child
    return found


def select_steps(run: Path, steps: dict[int, Path], *, last: int | None, every: int | None,
                 until: int | None) -> list[tuple[int, Path]]:
    """The chosen (step, directory) pairs of one run, oldest first."""
    chosen = sorted(s for s in steps if (until is None or s <= until) and (every is None or s % every == 0))
    if last is not None:
        if len(chosen) < last:
            rule = "".join([f" divisible by {every}" if every else "", f" up to step {until}" if until else ""])
            raise UpcyclerError(
                f"{run}: --last {last} asks for {last} checkpoints but only {len(chosen)} steps{rule} exist "
                f"({_preview(sorted(steps))}); lower --last or change --every/--until"
            )
        chosen = chosen[-last:]
    if not chosen:
        raise UpcyclerError(f"{run}: no step matches --every/--until (steps: {_preview(sorted(steps))})")
    return [(s, steps[s]) for s in chosen]


def checkpoint_in(step_dir: Path) -> Path:
    """The readable checkpoint of one step: the directory itself or one sub-directory (`params/` first)."""
    if is_checkpoint(step_dir):
        return step_dir
    children = sorted((c for c in step_dir.iterdir() if c.is_dir()), key=lambda c: (c.name != "params", c.name))
    for child in children:
        if is_checkpoint(child):
            return child
    raise UpcyclerError(
        f"{step_dir}: no readable checkpoint in this step directory or one level below; "
        "is the save finished? pass the checkpoint directory itself"
    )


def _preview(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, …, {steps[-1]}"
