"""`model.init_from_merge`: start a run from an average of checkpoints (PMA's merged initialisation).

The option is one string in `upcycle merge`'s own words: inputs (checkpoints or run directories), then
`--last K`, `--every S`, `--until STEP`, `--method M` (an averaging method: sma, ema, wma, minus-sqrt, …)
and the method's options (`--alpha A`), e.g. `runs/a --last 3 --method sma`. `plan_init_merge` checks it
all (the steps exist, the architectures agree with `model.init`) reading only checkpoint headers; the
merged tensors are computed lazily when the trainer loads them, one tensor at a time, and the merge is
recorded in the run's lineage like an `upcycle merge` output.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.io.checkpoint import Checkpoint
from upcycler.merge import METHODS, MergeInput, find_checkpoints, first_difference, merge, plan_merge
from upcycler.spec import ModelSpec
from upcycler.untrusted import describe

OPTION = "model.init_from_merge"
_STEP_FLAGS = ("--last", "--every", "--until")


def parse_init_merge(text: str) -> tuple[list[Path], dict[str, int], str, dict[str, Any]]:
    """(inputs, step selection {last, every, until}, method, method options) of the option's string."""
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise UpcyclerError(f"{OPTION} {describe(text)}: {err}; quote paths with spaces") from None
    paths: list[Path] = []
    steps: dict[str, int] = {}
    method, options = "sma", {}
    args = {arg.flag: arg for m in METHODS.values() for arg in m.args}
    seen: set[str] = set()
    it = iter(words)
    for word in it:
        if not word.startswith("--"):
            paths.append(Path(word))
            continue
        value = next(it, None)
        if value is None:
            raise UpcyclerError(f"{OPTION}: {word} needs a value; write e.g. 'RUN --last 3 --method sma'")
        if word in seen:
            raise UpcyclerError(f"{OPTION}: {describe(word)} is given twice; keep one")
        seen.add(word)
        if word in _STEP_FLAGS:
            steps[word[2:]] = _number(int, word, value)
        elif word == "--method":
            method = value
        elif word in args:
            options[args[word].name] = _number(args[word].type, word, value)
        else:
            raise UpcyclerError(f"{OPTION}: unknown option {describe(word)}; use --last, --every, --until, "
                                f"--method or a method option ({', '.join(sorted(args))})")
    if not paths:
        raise UpcyclerError(f"{OPTION} {describe(text)}: name a run directory or checkpoints to average")
    known = [name for name, m in METHODS.items() if m.kind == "average" and name != "linear"]
    if method not in known:
        raise UpcyclerError(f"{OPTION}: --method {describe(method)} is not an averaging method; use one of "
                            f"{', '.join(known)}")
    return paths, steps, method, options


def plan_init_merge(text: str, spec: ModelSpec) -> Checkpoint:
    """The merged checkpoint (lazy) the option describes, checked against the run's `spec`."""
    paths, steps, method, options = parse_init_merge(text)
    try:
        found = find_checkpoints(paths, **steps)
        plan = plan_merge([MergeInput(read_checkpoint(p), step) for p, step in found], method, options=options)
    except UpcyclerError as err:  # the merge's own words, said of this option
        raise UpcyclerError(f"{OPTION}: {err}") from None
    merged = merge(plan)
    if merged.spec != spec:
        where = first_difference(merged.spec, spec) or "the architecture"
        raise UpcyclerError(f"{OPTION}: the checkpoints to average differ from model.init in {where}; average "
                            "checkpoints of model.init's architecture")
    return merged


def _number(kind: Any, flag: str, value: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise UpcyclerError(f"{OPTION}: {flag} {describe(value)} is not a number") from None
