"""The format of `RUN_DIR/metrics.jsonl`, and reading it back checked.

The log holds one JSON object per step, written by the primary process only (`metrics_log`):

    step            the step's index (0-based; checkpoint N holds the state before step N)
    loss            mean next-token cross-entropy over the batch's real (mask = 1) target tokens
    loss/<source>   the same per data source (absent when the batch holds no token of that source)
    lb_loss, z_loss load-balancing and router z losses (mean over MoE layers; absent for dense models)
    total_loss      loss + lb_coef·lb_loss + z_coef·z_loss, what the gradient is of
    grad_norm       global L2 norm of the gradients before clipping
    technique/<name>
                    a figure an in-step technique adds to the step (`upcycler.train.techniques.in_step`),
                    e.g. technique/z_coef, the z-loss weight of the step under `loss.z_coef_ramp`
    lr              learning rate used by this step
    tokens          real target tokens in the batch
    step_time, tokens_per_s   wall time of the compiled step and B·L / step_time
    mfu             model FLOPs utilisation (FLOPs: `flops`) against the per-device peak of
                    `upcycler.train.reporting.peak`
    data_wait       seconds the loop waited for this step's batch
    clock, goodput  where the run's wall time went so far, across restarts (`upcycler.train.reporting.goodput`)
    eval/loss/<source>, eval/ppl/<source>
                    held-out loss and perplexity after this step, on the steps `eval.every` picks
                    (`upcycler.train.loop.heldout_eval`)
    eval_start/loss/<source>, eval_start/ppl/<source>
                    on step 0 of a run that starts from its init: the same of the starting parameters
    expert_load     per MoE layer, the fraction of token copies each expert received over the window of
                    `metrics.expert_load_every` steps that ends here; sums to 1 per layer
    expert_load_by_source, sources
                    on expert_load's lines and over the same window: per MoE layer, per data source,
                    the fraction of that source's token copies each expert received ([layers][sources]
                    [experts]; each row sums to 1, or is null when the window had no token of that source),
                    and `sources`, the data sources' names in the order of the rows
    expert_health   per MoE layer over the same window: load_min, load_max, load_cv, dead, overload,
                    entropy, bias_norm (`upcycler.train.techniques.expert_health`)
    spike           on a step the loss-spike guard caught: {action, median, averaged} (`spike_guard`)

The windows start at multiples of `metrics.expert_load_every` and end on the step before the next one
(or at the run's last step); a checkpoint saves the open window's sums, so a resumed run logs exactly
what it would have uninterrupted (`upcycler.train.techniques.expert_window`). Nothing is sampled: every
step's counts are in its window.

A resumed run first drops the lines of steps at or after its start step (`metrics_resume`), so the log
always describes one uninterrupted trajectory. A value that is not finite is written as null.

Reading (`read_metrics`, for `upcycle report` and resuming) treats the log as untrusted: every line goes
through the bounded JSON parser and `parse_metrics_line` checks each known field's type (numbers are
finite and at most `MAX_MAGNITUDE` in size, `step` at most `MAX_STEP`, `expert_load` is a rectangle of
shares in [0, 1] of the same shape on every line, `expert_load_by_source` a layers × sources × experts
block of shares of the same shape and the same `sources` on every line, source names (in `sources` and
`loss/<source>`) are printable (no control characters) and at most `MAX_NAME` characters);
unknown fields are kept as they are. A line is at most `MAX_JSON_BYTES` long; longer ones are refused after
reading that much of them, never read whole. A torn final line (no line break: a run killed mid-write) is
ignored; any other bad line is an `UpcyclerError` naming the file and the line.

What this module preserves: the fields above as the one description of a line, and the checks every
reader of the log (`upcycle report`, a resumed run) goes through.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.locations import is_remote
from upcycler.train.reporting import metrics_objects
from upcycler.train.reporting.goodput import CATEGORIES
from upcycler.train.techniques.expert_health import MAX_MAGNITUDE, check_logged_health
from upcycler.untrusted import MAX_JSON_BYTES, describe, integer, open_regular, parse_json, real, shown_path

METRICS_FILE = "metrics.jsonl"
NUMBER_FIELDS = (
    "loss", "lb_loss", "z_loss", "total_loss", "grad_norm", "lr", "tokens", "step_time", "tokens_per_s", "mfu",
    "data_wait", "goodput",
)
TIMING_FIELDS = ("step_time", "tokens_per_s", "mfu", "data_wait", "goodput", "clock")  # differ run to run
TECHNIQUE_PREFIX = "technique/"  # an in-step technique's scalar figure of the step
NUMBER_PREFIXES = ("loss/", "eval/loss/", "eval/ppl/", "eval_start/loss/", "eval_start/ppl/", TECHNIQUE_PREFIX)
_FIX = "fix or delete that line"
MAX_STEP = 2**53  # steps are plotted as floats: every step up to here is exact
MAX_NAME = 255  # a data source's name is a file-name stem


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of RUN_DIR/metrics.jsonl, in file order, each checked by `parse_metrics_line`.

    A torn last line (no final line break, not parseable) is skipped; any other bad line raises."""
    if is_remote(run_dir):
        data = metrics_objects.read_all(run_dir)
        if data is None:
            raise UpcyclerError(f"{shown_path(run_dir)}: no metrics ({metrics_objects.PREFIX}*.jsonl); pass the "
                                "run_dir of a continued-pretrain run")
        return _read_records(io.BytesIO(data), run_dir / f"{metrics_objects.PREFIX}*.jsonl")
    path = Path(run_dir) / METRICS_FILE
    with os.fdopen(open_regular(path, "metrics log"), "rb") as f:
        return _read_records(f, path)


def _read_records(f: BinaryIO, path: Path) -> list[dict[str, Any]]:
    """The checked records of the metrics lines in `f` (named `path` in errors); see `read_metrics`."""
    records: list[dict[str, Any]] = []
    load_shape: tuple[tuple[int, int], int] | None = None  # (shape, line of its first appearance)
    by_source: tuple[list[str], int, int | None, int] | None = None  # (sources, layers, experts, line)
    lineno = 0
    while line := _read_line(f, path, lineno + 1):
        lineno += 1
        where = f"{shown_path(path)}:{lineno}"
        try:
            record = parse_metrics_line(line, where)
        except UpcyclerError:
            if not line.endswith(b"\n"):
                break  # only the last line can lack a line break: torn by a run killed mid-write
            raise
        if record is None:
            continue
        if "expert_load" in record:
            shape = np.shape(record["expert_load"])
            if load_shape is None:
                load_shape = (shape, lineno)
            elif shape != load_shape[0]:
                raise UpcyclerError(
                    f"{where}: expert_load is {shape[0]}×{shape[1]}, but line {load_shape[1]} has "
                    f"{load_shape[0][0]}×{load_shape[0][1]} (layers × experts); {_FIX}"
                )
        if "expert_load_by_source" in record:
            by_source = _same_by_source(record, by_source, lineno, where)
        records.append(record)
    return records


def _same_by_source(
    record: dict[str, Any], first: tuple[list[str], int, int | None, int] | None, lineno: int, where: str
) -> tuple[list[str], int, int | None, int]:
    """The sources, layers and experts (None while every row was null) of the (checked)
    `expert_load_by_source` lines so far, first seen on line `first[3]`; `UpcyclerError` naming `where`
    when this line's differ."""
    shares = record["expert_load_by_source"]
    experts = next((len(row) for layer in shares for row in layer if row is not None), None)
    if first is None:
        return record["sources"], len(shares), experts, lineno
    sources, layers, first_experts, line = first
    if record["sources"] != sources:
        raise UpcyclerError(f"{where}: sources are {_names(record['sources'])}, but line {line} has "
                            f"{_names(sources)}; {_FIX}")
    if len(shares) != layers or (None not in (experts, first_experts) and experts != first_experts):
        shape = f"{len(shares)}×{len(sources)}×{experts}"
        raise UpcyclerError(f"{where}: expert_load_by_source is {shape}, but line {line} has "
                            f"{layers}×{len(sources)}×{first_experts} (layers × sources × experts); {_FIX}")
    return sources, layers, first_experts if first_experts is not None else experts, line


def _names(sources: Sequence[str]) -> str:
    """Source names from a file for a one-line message: quoted, escaped, at most 8."""
    more = f", … ({len(sources)})" if len(sources) > 8 else ""
    return "[" + ", ".join(describe(name, 30) for name in sources[:8]) + more + "]"


def _read_line(f: Any, path: Path, lineno: int) -> bytearray:
    """Line `lineno` of `f`, read in pieces of 1 MiB up to `MAX_JSON_BYTES` + 1 bytes and refused beyond
    (never read whole; the pieces grow one buffer, so a refused line costs about the limit in memory)."""
    line = bytearray()
    try:
        while len(line) <= MAX_JSON_BYTES and not line.endswith(b"\n"):
            piece = f.readline(min(1 << 20, MAX_JSON_BYTES + 1 - len(line)))
            if not piece:
                break
            line += piece
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot read ({err.strerror}); check the file") from None
    if len(line) > MAX_JSON_BYTES:
        raise UpcyclerError(
            f"{shown_path(path)}:{lineno}: line longer than {MAX_JSON_BYTES:,} bytes (the limit for one "
            f"metrics record); not a metrics log the trainer wrote; {_FIX}"
        )
    return line


def parse_metrics_line(line: str | bytes, where: str) -> dict[str, Any] | None:
    """The record of one metrics.jsonl line (None for a blank line), or `UpcyclerError` naming `where`.

    `step` is a non-negative integer; the fields of `NUMBER_FIELDS`, `loss/<source>` and
    `eval/{loss,ppl}/<source>` (`eval_start/…` too) are finite numbers or null; `clock` maps every goodput category, `total`
    and `wall` to a finite non-negative number; `expert_load` is a non-empty rectangle of finite numbers (layers × experts);
    `expert_load_by_source` is a non-empty block layers × sources × experts of numbers in [0, 1], a whole
    source row possibly null, with `sources` beside it naming each source once (and the
    layers and experts of `expert_load` when the line has both)."""
    if not line.strip():
        return None
    record = parse_json(line, where, _FIX)
    if not isinstance(record, dict):
        raise UpcyclerError(f"{where}: expected a JSON object per step, found {describe(record)}; {_FIX}")
    if "step" not in record:
        raise UpcyclerError(f"{where}: no step; {_FIX}")
    integer(record["step"], "step", where, low=0, high=MAX_STEP, fix=_FIX)
    for key, value in record.items():
        prefix = next((p for p in NUMBER_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            _check_name(key[len(prefix):], f"the source of a {prefix}<source> field", where)
        if (key in NUMBER_FIELDS or prefix is not None) and value is not None:
            real(value, key, where, low=-MAX_MAGNITUDE, high=MAX_MAGNITUDE, fix=_FIX)
    if "clock" in record:
        _check_clock(record["clock"], where)
    if "expert_load" in record:
        _check_load(record["expert_load"], where)
    if "sources" in record:
        _check_sources(record["sources"], where)
    if "expert_load_by_source" in record:
        _check_load_by_source(record, where)
    if "expert_health" in record:
        check_logged_health(record["expert_health"], where, fix=_FIX)
    return record


def _check_clock(clock: Any, where: str) -> None:
    """`clock` as `parse_metrics_line` documents it, or `UpcyclerError` naming `where`."""
    keys = (*CATEGORIES, "total", "wall")
    if not isinstance(clock, dict) or any(k not in clock for k in keys):
        raise UpcyclerError(f"{where}: clock must map {', '.join(keys)} to seconds, not {describe(clock)}; {_FIX}")
    for key in keys:
        real(clock[key], f"clock.{key}", where, low=0.0, high=MAX_MAGNITUDE, fix=_FIX)


def _check_load(load: Any, where: str) -> None:
    rows = load if isinstance(load, list) else None
    if not rows or not all(isinstance(row, list) and row for row in rows):
        raise UpcyclerError(f"{where}: expert_load must be a list of per-layer lists of shares, not "
                            f"{describe(load)}; {_FIX}")
    if len({len(row) for row in rows}) != 1:
        raise UpcyclerError(f"{where}: expert_load rows have different lengths (ragged); {_FIX}")
    for row in rows:
        for share in row:
            real(share, "expert_load", where, low=0.0, high=1.0, fix=_FIX)


def _check_sources(sources: Any, where: str) -> None:
    """`sources` is a non-empty list of distinct non-empty names, or `UpcyclerError` naming `where`."""
    if (not isinstance(sources, list) or not sources
            or not all(isinstance(name, str) and name for name in sources)):
        raise UpcyclerError(f"{where}: sources must be a non-empty list of source names, not "
                            f"{describe(sources)}; {_FIX}")
    for name in sources:
        _check_name(name, "a source in sources", where)
    if len(set(sources)) != len(sources):
        raise UpcyclerError(f"{where}: sources names a source twice; {_FIX}")


def _check_name(name: str, what: str, where: str) -> None:
    """`name` can be a data source's name (printable, 1 to `MAX_NAME` characters), or `UpcyclerError`."""
    if not (0 < len(name) <= MAX_NAME and name.isprintable()):
        raise UpcyclerError(f"{where}: {what} is {describe(name, 40)}, not a data source's name (printable, "
                            f"1 to {MAX_NAME} characters); {_FIX}")


def _check_load_by_source(record: dict[str, Any], where: str) -> None:
    """`expert_load_by_source` as `parse_metrics_line` documents it, or `UpcyclerError` naming `where`."""
    layers = record["expert_load_by_source"]
    if "sources" not in record:
        raise UpcyclerError(f"{where}: expert_load_by_source without sources (the names of its rows); {_FIX}")
    sources = record["sources"]
    if not isinstance(layers, list) or not layers or not all(isinstance(layer, list) for layer in layers):
        raise UpcyclerError(f"{where}: expert_load_by_source must be a list of per-layer lists of per-source "
                            f"shares, not {describe(layers)}; {_FIX}")
    rows = [row for layer in layers for row in layer]
    if any(len(layer) != len(sources) for layer in layers):
        raise UpcyclerError(f"{where}: expert_load_by_source must have one row per source in every layer "
                            f"({len(sources)}: {_names(sources)}); {_FIX}")
    if not all(row is None or (isinstance(row, list) and row) for row in rows):
        raise UpcyclerError(f"{where}: expert_load_by_source rows must be non-empty lists of shares or null; "
                            f"{_FIX}")
    if len({len(row) for row in rows if row is not None}) > 1:
        raise UpcyclerError(f"{where}: expert_load_by_source rows have different lengths (ragged); {_FIX}")
    for row in rows:
        for share in row or ():
            real(share, "expert_load_by_source", where, low=0.0, high=1.0, fix=_FIX)
    load = record.get("expert_load")
    experts = next((len(row) for row in rows if row is not None), None)
    if isinstance(load, list) and (len(load) != len(layers) or experts not in (None, len(load[0]))):
        raise UpcyclerError(f"{where}: expert_load_by_source covers {len(layers)} layers × {experts} "
                            f"experts, but expert_load {len(load)} × {len(load[0])}; {_FIX}")
