"""Where `prepare-data`'s units run: an Apache Beam pipeline (the one module that imports Beam).

Beam is the engine users of this stack already run for data preparation: its DirectRunner runs the same
pipeline on a laptop (one process, or `workers` processes), and Dataflow, Flink or Spark run it on a
cluster by a runner option (`--runner`, `--beam-option KEY=VALUE`). `array_record` ships its conversion
pipelines for Beam too. The pipeline has two branches: every unit through `shard_writer.write_shard` (which also hashes the
whole files it read), and every file split over several units through `shard_writer.digest_file`. Both write their results into the work directory,
which `prepare` reads when the pipeline is done, so nothing depends on what the runner collects or in
which order it runs the elements: the output is the same bytes for any runner and any worker count.

A cluster runner's workers must see the inputs and the work directory at the same paths (a shared
filesystem); reading inputs from and working in a bucket on a cluster is not built yet.

`check_engine` refuses, before anything is written, a runner Beam does not have and a `--beam-option` it
does not know (Beam itself only logs a warning and drops it) or whose value its parser refuses (which
would otherwise exit from inside Beam, without a word while workers' output is hidden).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import NoReturn

from upcycler.errors import UpcyclerError
from upcycler.train.data.plan import Plan, Unit
from upcycler.untrusted import describe, escape

DEFAULT_RUNNER = "DirectRunner"


class EngineFailure(UpcyclerError):
    """The runner failed for a reason of its own (not a unit's input): the finished shards stay for a rerun."""


def check_engine(runner: str, workers: int, beam_options: Sequence[str] = ()) -> None:
    """Refuse `runner` and `beam_options` (KEY=VALUE) in one line unless Beam would run them as given (see
    the module docstring); nothing is written."""
    with _beam_quiet():
        pipeline_options(runner, workers, beam_options)


def pipeline_options(runner: str, workers: int, extra: Sequence[str] = ()):
    """Beam options for `runner`; on the DirectRunner, `workers` > 1 runs that many worker processes. The
    runner and every option of `extra` are checked first (`check_engine`)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = [f"--runner={runner}"]
    if runner == DEFAULT_RUNNER:
        mode = "in_memory" if workers == 1 else "multi_processing"
        flags += [f"--direct_num_workers={workers}", f"--direct_running_mode={mode}",
                  "--default_sdk_harness_log_level=ERROR"]
    for option in extra:
        key, sep, value = option.partition("=")
        if not sep or not key or key.startswith("-"):
            raise UpcyclerError(f"--beam-option {describe(option)}: expected KEY=VALUE, e.g. project=my-project")
        flags.append(f"--{key}={value}")
    _check_runner(runner, extra)
    options = PipelineOptions(flags)
    _check_flags(options, extra)
    return options


def _check_runner(runner: str, extra: Sequence[str]) -> None:
    """Refuse a runner Beam cannot create (the last `runner=` of `extra` overrides `runner`); creating it
    also registers the options of its module, for `_check_flags`."""
    from apache_beam.runners.runner import create_runner

    given = [o for o in extra if o.partition("=")[0] == "runner"]
    name, what = (given[-1].partition("=")[2], f"--beam-option {describe(given[-1])}") if given else (
        runner, f"--runner {describe(runner)}")
    try:
        create_runner(name)
    except (ValueError, ImportError, AttributeError, TypeError) as err:
        reason = escape(str(err).strip() or type(err).__name__)[:400]
        _, listed, runners = reason.partition("Valid values are ")
        fix = f"use one of {runners.rstrip('.')}" if listed else f"{reason}; use a Beam runner such as DirectRunner"
        raise UpcyclerError(f"{what}: not a runner Apache Beam can create; {fix}") from None


def _check_flags(options, extra: Sequence[str]) -> None:
    """Refuse an option of `extra` whose value Beam's parser refuses (naming the values it allows), or that
    no registered set of Beam options defines (naming the closest that does)."""
    known = _all_options(options, extra, retain_unknown=False)
    unknown = _all_options(options, extra, retain_unknown=True).keys() - known.keys()
    for option in extra:
        key = option.partition("=")[0]
        if key.replace("-", "_") in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else "; check its spelling"
            raise UpcyclerError(f"--beam-option {describe(option)}: not an option Apache Beam knows{hint}")


def _all_options(options, extra: Sequence[str], *, retain_unknown: bool) -> dict:
    """Beam's own parse of `options` (with the options it does not know, if `retain_unknown`); a value its
    parser refuses raises one line naming the option of `extra` it came from."""
    try:
        return options.get_all_options(retain_unknown_options=retain_unknown, add_extra_args_fn=_raise_on_error)
    except argparse.ArgumentError as err:
        name = (err.argument_name or "").split("/")[0].lstrip("-").replace("-", "_")
        given = [o for o in extra if o.partition("=")[0].replace("-", "_") == name]
        what = f"--beam-option {describe(given[-1])}" if given else "--beam-option"
        raise UpcyclerError(f"{what}: {escape(err.message)[:300]}; fix its value") from None


def _raise_on_error(parser: argparse.ArgumentParser) -> None:
    """Make Beam's option parser raise `argparse.ArgumentError` where it would print usage and exit."""
    parser.exit_on_error = False
    parser.error = _argument_error


def _argument_error(message: str) -> NoReturn:
    raise argparse.ArgumentError(None, message)


@contextlib.contextmanager
def _beam_quiet() -> Iterator[None]:
    """Beam's warnings (optional-dependency notices, runner chatter, dropped options: the latter are refused
    by `_check_flags` instead) are not shown while this holds."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def run_units(plan: Plan, work: str, *, units: Sequence[Unit] | None = None, runner: str = DEFAULT_RUNNER,
              workers: int = 1, beam_options: Sequence[str] = ()) -> None:
    """Run `units` of `plan` (all of them by default; and every split input's digest) on Beam; their
    results land in `work`. The local runner starts no more worker processes than there are units (one
    runs in this process): what a rerun has left may be a unit or two.

    An engine failure that is not a unit's own recorded error becomes one `UpcyclerError` line.
    """
    pending = plan.units if units is None else units
    if runner == DEFAULT_RUNNER:
        workers = max(1, min(workers, len(pending)))
    with _beam_quiet(), _worker_chatter_hidden(runner == DEFAULT_RUNNER):
        _run(plan, pending, work, runner, pipeline_options(runner, workers, beam_options))


@contextlib.contextmanager
def _worker_chatter_hidden(hide: bool):
    """While the local runner runs, its worker processes' log lines (they inherit our stderr) go to a
    scratch file: the command's own output stays one summary, or one error line. Cluster runners keep
    theirs (the job's address and progress are for the user)."""
    if not hide:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _run(plan: Plan, pending: Sequence[Unit], work: str, runner: str, options) -> None:
    import apache_beam as beam

    units = [(unit, {p.file: plan.files[unit.source][p.file] for p in unit.pieces}) for unit in pending]
    split = sorted({(unit.source, p.file) for unit in plan.units for p in unit.pieces if p.start is not None})
    files = [(name, number, plan.files[name][number]) for name, number in split]
    settings = plan.settings
    try:
        with beam.Pipeline(options=options) as pipeline:
            (pipeline
             | "units" >> beam.Create(units, reshuffle=False)
             | "spread units" >> beam.Reshuffle()
             | "tokenise" >> beam.Map(_tokenise, settings, work))
            (pipeline
             | "files" >> beam.Create(files, reshuffle=False)
             | "spread files" >> beam.Reshuffle()
             | "digest" >> beam.Map(_digest, work))
    except (KeyboardInterrupt, UpcyclerError):
        raise
    except Exception as err:  # noqa: BLE001 - any runner failure: shown as one line, work kept for a rerun
        interrupt = _interrupt_within(err)
        if interrupt is not None:  # Ctrl-C or SIGTERM inside a transform, which the runner wraps
            raise interrupt from None
        first = escape(str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        raise EngineFailure(
            f"prepare-data: the {runner} pipeline failed ({first[:200]}); fix the cause and rerun: "
            "finished shards are kept"
        ) from None


def _interrupt_within(err: BaseException) -> KeyboardInterrupt | None:
    """The interrupt (`KeyboardInterrupt`, SIGTERM's included) that a runner's error wraps, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _tokenise(element: tuple, settings, work: str) -> dict:
    """One unit on a Beam worker (see `shard_writer.write_shard`)."""
    from upcycler.train.data.shard_writer import write_shard

    unit, files = element
    return write_shard(unit, files, settings, work)


def _digest(element: tuple, work: str) -> dict:
    """One input file's digest on a Beam worker (see `shard_writer.digest_file`)."""
    from upcycler.train.data.shard_writer import digest_file

    return digest_file(*element, work)
