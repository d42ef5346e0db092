"""`upcycle merge CKPT… OUT --method M`: merge checkpoints or the last steps of a training run, streaming.

Inputs are HF or Orbax checkpoint directories, or run directories whose steps are picked with
`--last/--every/--until` (`upcycler.merge.runs`). The method's own options (`--alpha`, `--t`,
`--density`, `--lambda`) are generated from the registry, so a new method needs no change here.
`--dry-run` prints the plan and the weights after reading only the checkpoint headers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from upcycler.cli.options import output_options, write_output
from upcycler.cli.path_type import OUTPUT, SOURCE
from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.io.staging import check_output
from upcycler.merge import METHODS, MergeInput, describe_plan, find_checkpoints, merge, plan_merge
from upcycler.schema import Option


def _method_args() -> dict[str, tuple[Option, dict[str, Any]]]:
    """Each method option once, with the default of every method that takes it."""
    out: dict[str, tuple[Option, dict[str, Any]]] = {}
    for method in METHODS.values():
        for arg in method.args:
            out.setdefault(arg.name, (arg, {}))[1][method.name] = arg.default
    return out


def method_options(fn: Callable) -> Callable:
    """A click option per method option (`--alpha`, `--t`, …), defaulting to the method's own default."""
    for name, (arg, defaults) in reversed(_method_args().items()):
        values = set(defaults.values())
        used = f"{values.pop():g}" if len(values) == 1 else ", ".join(f"{m} {d:g}" for m, d in defaults.items())
        fn = click.option(arg.flag, name, type=arg.type, default=None, help=f"{arg.help} (default: {used}).")(fn)
    return fn


def _epilog() -> str:
    rows = [f"{name}: {m.summary}" + (" Needs --base." if m.needs_base else "") for name, m in METHODS.items()]
    return "\b\nMethods:\n" + "\n".join(f"  {row}" for row in rows)


@click.command("merge", epilog=_epilog())
@click.argument("paths", nargs=-1, required=True, type=SOURCE)
@click.argument("out", type=OUTPUT)
@click.option("--method", required=True, type=click.Choice(list(METHODS)), help="Merge method (see below).")
@click.option("--base", type=SOURCE, help="Base model of the task-vector methods.")
@click.option("--weights", metavar="W1,W2,…", help="One weight per input (linear; scales for task methods).")
@click.option("--no-normalize", is_flag=True, help="linear: apply --weights as given, not requiring a sum of 1.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random drops (dare-*).")
@click.option("--last", type=int, metavar="K", help="From a run directory, merge the K newest chosen steps.")
@click.option("--every", type=int, metavar="S", help="From a run directory, only steps divisible by S.")
@click.option("--until", type=int, metavar="STEP", help="From a run directory, ignore steps after STEP.")
@click.option("--dry-run", is_flag=True, help="Print the plan and the weights; read no tensor, write nothing.")
@method_options
@output_options
def command(paths: tuple[Path, ...], out: Path, method: str, base: Path | None, weights: str | None,
            no_normalize: bool, seed: int, last: int | None, every: int | None, until: int | None,
            dry_run: bool, **rest: Any) -> None:
    """Merge the checkpoints PATHS (oldest first; run directories expand to their steps) into OUT."""
    given = {name: rest.pop(name) for name in _method_args()}
    options = {name: value for name, value in given.items() if value is not None}
    found = find_checkpoints(paths, last=last, every=every, until=until)
    _check_output(out, [p for p, _ in found] + ([base] if base else []), rest["overwrite"])
    plan = plan_merge(
        [MergeInput(read_checkpoint(p), step) for p, step in found], method,
        base=read_checkpoint(base) if base else None, weights=_parse_weights(weights), normalize=not no_normalize,
        seed=seed, dtype=rest["dtype"], options=options,
    )
    if dry_run:
        click.echo(describe_plan(plan))
        click.echo(f"write    {out} ({rest['to']}); dry run, nothing written")
        return
    _return_freed_tensors_to_the_os()
    written = write_output(merge(plan), out, **{**rest, "dtype": None})
    click.echo(f"wrote {written}")


def _return_freed_tensors_to_the_os() -> None:
    """Make glibc map every buffer of 1 MiB or more on its own, so a freed tensor leaves the process at once.

    By default glibc keeps freed buffers below an adaptive size in per-thread heaps; with reads, merges
    and writes on different threads, those leftovers made the peak drift up by a tensor or two.
    Elsewhere (no glibc) this does nothing.
    """
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(w) for w in text.replace(" ", ",").split(",") if w]
    except ValueError:
        raise UpcyclerError(f"--weights {text!r}: give numbers separated by commas, e.g. 0.5,0.3,0.2") from None


def _check_output(out: Path, inputs: list[Path], overwrite: bool) -> None:
    """Refuse OUT before reading anything (the writer checks again before it writes)."""
    check_output(out, overwrite=overwrite, sources=inputs)
