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
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Sequence

from upcycler.errors import UpcyclerError
from upcycler.train.data.plan import Plan
from upcycler.untrusted import describe, escape

DEFAULT_RUNNER = "DirectRunner"


class EngineFailure(UpcyclerError):
    """The runner failed for a reason of its own (not a unit's input): the finished shards stay for a rerun."""


def pipeline_options(runner: str, workers: int, extra: Sequence[str] = ()):
    """Beam options for `runner`; on the DirectRunner, `workers` > 1 runs that many worker processes."""
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
    return PipelineOptions(flags)


def run_units(plan: Plan, work: str, *, runner: str = DEFAULT_RUNNER, workers: int = 1,
              beam_options: Sequence[str] = ()) -> None:
    """Run every unit of `plan` (and every input's digest) on Beam; their results land in `work`.

    An engine failure that is not a unit's own recorded error becomes one `UpcyclerError` line.
    """
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # Beam logs optional-dependency notices and runner chatter as warnings
    try:
        with _worker_chatter_hidden(runner == DEFAULT_RUNNER):
            _run(plan, work, runner, pipeline_options(runner, workers, beam_options))
    finally:
        root.setLevel(level)


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


def _run(plan: Plan, work: str, runner: str, options) -> None:
    import apache_beam as beam

    units = [(unit, {p.file: plan.files[unit.source][p.file] for p in unit.pieces}) for unit in plan.units]
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
        first = escape(str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        raise EngineFailure(
            f"prepare-data: the {runner} pipeline failed ({first[:200]}); fix the cause and rerun: "
            "finished shards are kept"
        ) from None


def _tokenise(element: tuple, settings, work: str) -> dict:
    """One unit on a Beam worker (see `shard_writer.write_shard`)."""
    from upcycler.train.data.shard_writer import write_shard

    unit, files = element
    return write_shard(unit, files, settings, work)


def _digest(element: tuple, work: str) -> dict:
    """One input file's digest on a Beam worker (see `shard_writer.digest_file`)."""
    from upcycler.train.data.shard_writer import digest_file

    return digest_file(*element, work)
