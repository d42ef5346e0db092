"""Per-step training metrics: the JSONL log, model FLOPs and MFU, and the progress display.

`RUN_DIR/metrics.jsonl` gets one JSON object per step, written by the primary process only:

    step            the step's index (0-based; checkpoint N holds the state before step N)
    loss            mean next-token cross-entropy over the batch's real (mask = 1) target tokens
    loss/<source>   the same per data source (absent when the batch holds no token of that source)
    lb_loss, z_loss load-balancing and router z losses (mean over MoE layers; absent for dense models)
    total_loss      loss + lb_coef·lb_loss + z_coef·z_loss, what the gradient is of
    grad_norm       global L2 norm of the gradients before clipping
    lr              learning rate used by this step
    tokens          real target tokens in the batch
    step_time, tokens_per_s   wall time of the compiled step and B·L / step_time
    mfu             model FLOPs utilisation against the per-device peak of `upcycler.train.reporting.peak`
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

The windows start at multiples of `metrics.expert_load_every` and end on the step before the next one
(or at the run's last step); a checkpoint saves the open window's sums, so a resumed run logs exactly
what it would have uninterrupted. Nothing is sampled: every step's counts are in its window.
    spike           on a step the loss-spike guard caught: {action, median, averaged} (`spike_guard`)

A resumed run first drops the lines of steps at or after its start step (they were not checkpointed), so
the log always describes one uninterrupted trajectory; it reads the log backwards from its end, only as
far as the last line it keeps (a resume costs the same after 10 or 100,000 steps). A value that is not
finite is written as null.

Reading (`read_metrics`, for `upcycle report` and resuming) treats the log as untrusted: every line goes
through the bounded JSON parser and `parse_metrics_line` checks each known field's type (numbers are
finite and at most `MAX_MAGNITUDE` in size, `step` at most `MAX_STEP`, `expert_load` is a rectangle of
shares in [0, 1] of the same shape on every line, `expert_load_by_source` a layers × sources × experts
block of shares of the same shape and the same `sources` on every line, source names (in `sources` and
`loss/<source>`) are printable (no control characters) and at most `MAX_NAME` characters);
unknown fields are kept as they are. A line is at most `MAX_JSON_BYTES` long; longer ones are refused after
reading that much of them, never read whole. A torn final line (no line break: a run killed mid-write) is
ignored; any other bad line is an `UpcyclerError` naming the file and the line.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np

from upcycler.bucket_client import refusals
from upcycler.errors import UpcyclerError
from upcycler.layout import declare_params
from upcycler.locations import is_remote
from upcycler.spec import ModelSpec
from upcycler.train.reporting import metrics_objects
from upcycler.train.reporting.goodput import CATEGORIES
from upcycler.train.techniques.expert_health import MAX_MAGNITUDE, check_logged_health, layer_health
from upcycler.untrusted import MAX_JSON_BYTES, describe, integer, open_regular, parse_json, real, shown_path

METRICS_FILE = "metrics.jsonl"
NUMBER_FIELDS = (
    "loss", "lb_loss", "z_loss", "total_loss", "grad_norm", "lr", "tokens", "step_time", "tokens_per_s", "mfu",
    "data_wait", "goodput",
)
TIMING_FIELDS = ("step_time", "tokens_per_s", "mfu", "data_wait", "goodput", "clock")  # differ run to run
NUMBER_PREFIXES = ("loss/", "eval/loss/", "eval/ppl/", "eval_start/loss/", "eval_start/ppl/")
_FIX = "fix or delete that line"
MAX_STEP = 2**53  # steps are plotted as floats: every step up to here is exact
MAX_NAME = 255  # a data source's name is a file-name stem


def matmul_params(spec: ModelSpec) -> int:
    """Parameters that take part in a matmul for one token: every weight matrix but the embedding
    lookup (the LM head counts, tied or not), routed experts counted `top_k` times, norms and biases not."""
    total = spec.vocab_size * spec.hidden_size if spec.tie_embeddings else 0
    for p in declare_params(spec):
        if p.name == "embed" or len(p.shape) < 2 or p.is_buffer:
            continue
        if p.expert_stacked:
            total += p.numel // p.shape[0] * spec.moe.top_k  # type: ignore[union-attr]
        else:
            total += p.numel
    return total


def flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6·matmul params + causal attention 6·layers·H·h·L."""
    attention = 6 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len
    return 6.0 * matmul_params(spec) + attention


class MetricsLog:
    """Appends one JSON line per step to RUN_DIR/metrics.jsonl (a no-op on non-primary processes); in a
    bucket run_dir, keeps the lines since the last checkpoint and writes them as one object when the
    trainer says a checkpoint was saved (`saved`) and at `close` (`metrics_objects`).

    Opening it drops the records at or after `start_step`; `kept` and `last` are then the last record
    kept and the last record there was (each None when there is none), for the goodput clock."""

    def __init__(self, run_dir: Path, *, enabled: bool, start_step: int):
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.kept: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self._file: TextIO | None = None
        self._pending: tuple[list[int], list[str]] | None = None  # bucket run_dir: (steps, lines) not written
        if enabled and is_remote(run_dir):
            self.kept, self.last = _parsed(metrics_objects.tail(run_dir, start_step), run_dir)
            metrics_objects.truncate_from(run_dir, start_step)
            self._pending = ([], [])
        elif enabled:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.kept, self.last = _truncate_from(self.path, start_step)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
            except OSError as err:
                raise UpcyclerError(
                    f"{shown_path(self.path)}: cannot write ({err.strerror}); choose a writable run_dir"
                ) from None

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(_finite(record), allow_nan=False) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        elif self._pending is not None:
            self._pending[0].append(int(record["step"]))
            self._pending[1].append(line)

    def saved(self) -> None:
        """A checkpoint was saved: in a bucket run_dir, write the lines since the previous one. A write the
        bucket refuses (once retried) is one line naming the run_dir; nothing more is written after it."""
        if self._pending is not None:
            steps, lines = self._pending
            try:
                metrics_objects.write_interval(self.run_dir, steps, lines)
            except refusals() as err:
                self._pending = None  # `close` does not try again: the run ends on this error
                raise UpcyclerError(
                    f"{self.run_dir}: writing the metrics of steps {steps[0]}-{steps[-1]} failed "
                    f"({describe(str(err).strip() or type(err).__name__, 200)}); check that run_dir can be "
                    "written (credentials, permissions, quota, the network), then run the same command again: "
                    "it resumes from the last committed step, without these steps' metrics") from None
            self._pending = ([], [])

    def close(self) -> None:
        self.saved()
        if self._file is not None:
            self._file.close()
            self._file = None


def step_record(
    step: int,
    raw: Mapping[str, Any],
    *,
    sources: Sequence[str],
    step_time: float,
    batch_tokens: int,
    flops_per_step: float,
    peak_flops: float | None,
    num_devices: int,
    window: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON record of one step from the train step's (host) metric arrays, with the expert window that
    ends here (`ExpertWindow.take`), when given."""
    rec: dict[str, Any] = {"step": step, "loss": float(raw["loss"])}
    src_loss, src_tokens = np.asarray(raw["source_loss"]), np.asarray(raw["source_tokens"])
    for name, loss_sum, count in zip(sources, src_loss, src_tokens):
        if count > 0:
            rec[f"loss/{name}"] = float(loss_sum / count)
    for key in ("lb_loss", "z_loss"):
        if key in raw:
            rec[key] = float(raw[key])
    rec.update(
        total_loss=float(raw["total_loss"]),
        grad_norm=float(raw["grad_norm"]),
        lr=float(raw["lr"]),
        tokens=int(raw["tokens"]),
        step_time=step_time,
        tokens_per_s=batch_tokens / step_time,
    )
    if peak_flops:
        rec["mfu"] = flops_per_step / step_time / (peak_flops * num_devices)
    if window:
        rec.update(window)
    return rec


def load_shares(counts_ME: Any) -> list[list[float]]:
    """`expert_load` from counts [M, E]: each layer's row divided by its sum, rounded to 6 decimals."""
    counts = np.asarray(counts_ME, dtype=np.float64)
    return np.round(counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0), 6).tolist()


def source_shares(counts_MSE: Any) -> list[list[list[float] | None]]:
    """`expert_load_by_source` from per-source counts [M, S, E]: each (layer, source) row divided by its
    sum and rounded to 6 decimals (as `expert_load`), so it sums to 1; None for a source without tokens."""
    counts = np.asarray(counts_MSE, dtype=np.float64)
    totals = counts.sum(axis=2, keepdims=True)
    shares = np.round(counts / np.where(totals > 0, totals, 1.0), 6)
    return [[row.tolist() if total > 0 else None for row, total in zip(layer, layer_totals[:, 0])]
            for layer, layer_totals in zip(shares, totals)]


class ExpertWindow:
    """Token copies per expert (in all and per data source), router entropy and selection bias over the
    steps since the window opened; `take` turns them into the record's `expert_load`,
    `expert_load_by_source` and `expert_health` and opens a new window. `state` / `restore` carry an open
    window through a checkpoint (integers and float sums, exact in JSON)."""

    def __init__(self, spec: ModelSpec, dead_below: float, sources: Sequence[str] = ()):
        self.top_k = spec.moe.top_k if spec.moe is not None else 1  # unused for a dense model: no counts
        self.dead_below = dead_below
        self.sources = list(sources)
        self._counts: np.ndarray | None = None
        self._by_source: np.ndarray | None = None
        self._entropy: np.ndarray | None = None
        self._steps = 0
        self._bias: np.ndarray | None = None

    def add(self, raw: Mapping[str, Any]) -> None:
        """Add one step's host metrics (a dense model's carry no expert counts: nothing happens)."""
        if "expert_counts" not in raw:
            return
        counts = np.asarray(raw["expert_counts"], np.int64)
        entropy = np.asarray(raw["router_entropy"], np.float64)
        self._counts = counts if self._counts is None else self._counts + counts
        self._entropy = entropy if self._entropy is None else self._entropy + entropy
        if "expert_counts_by_source" in raw:
            by_source = np.asarray(raw["expert_counts_by_source"], np.int64)
            self._by_source = by_source if self._by_source is None else self._by_source + by_source
        self._steps += 1
        if "selection_bias" in raw:
            self._bias = np.asarray(raw["selection_bias"], np.float64)

    def take(self) -> dict[str, Any] | None:
        """The window's record fields (None before any MoE step), and an empty window."""
        if self._counts is None:
            return None
        out: dict[str, Any] = {"expert_load": load_shares(self._counts)}
        if self._by_source is not None:
            out.update(expert_load_by_source=source_shares(self._by_source), sources=list(self.sources))
        out["expert_health"] = layer_health(self._counts, self.top_k, self.dead_below,
                                            self._entropy / self._steps, self._bias)
        self._counts = self._by_source = self._entropy = None
        self._steps = 0
        return out

    def state(self) -> dict[str, Any]:
        """The open window as plain JSON data (empty when nothing was added)."""
        if self._counts is None:
            return {}
        state = {"steps": self._steps, "counts": self._counts.tolist(), "entropy": self._entropy.tolist()}
        if self._by_source is not None:
            state["by_source"] = self._by_source.tolist()
        if self._bias is not None:
            state["bias"] = self._bias.tolist()
        return state

    def restore(self, state: Mapping[str, Any], where: str) -> None:
        """Reopen a window saved by `state` (a checkpoint's meta, checked: `UpcyclerError` naming `where`)."""
        if not state:
            return
        try:
            steps = int(state["steps"])
            counts = np.asarray(state["counts"], np.int64)
            entropy = np.asarray(state["entropy"], np.float64)
            by_source = np.asarray(state["by_source"], np.int64) if "by_source" in state else None
            bias = np.asarray(state["bias"], np.float64) if "bias" in state else None
        except (KeyError, TypeError, ValueError, OverflowError):
            steps, counts = 0, np.zeros(0)
        if (steps < 1 or counts.ndim != 2 or (counts < 0).any() or entropy.shape != counts.shape[:1]
                or not np.isfinite(entropy).all()
                or (by_source is not None and by_source.shape != (counts.shape[0], len(self.sources), counts.shape[1]))):
            raise UpcyclerError(f"{where}: meta expert_window is not an open window of this model's expert "
                                "counts; the checkpoint is damaged; resume from an earlier step")
        self._steps, self._counts, self._entropy, self._by_source, self._bias = steps, counts, entropy, by_source, bias


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


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


_STEP_PREFIX = re.compile(rb'^\{"step": (\d+)[,}]')
_TAIL_BLOCK = 1 << 20


def _truncate_from(path: Path, start_step: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
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


class Progress:
    """A tqdm bar on an interactive terminal; otherwise a plain line every `every` steps (primary only)."""

    def __init__(self, *, enabled: bool, start: int, total: int, every: int = 10):
        self.every = every
        self.enabled = enabled
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: Mapping[str, Any], experts: str = "") -> None:
        """Show one step's record; `experts` is the expert-health summary of its window, when it has one."""
        if not self.enabled:
            return
        summary = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s"
        if "mfu" in record:
            summary += f" mfu {100 * record['mfu']:.1f}%"
        if "goodput" in record:
            summary += f" goodput {100 * record['goodput']:.0f}%"
        if experts:
            summary += f" {experts}"
        if self._bar is not None:
            self._bar.set_postfix_str(summary, refresh=False)
            self._bar.update(1)
        elif record["step"] % self.every == 0:
            print(f"step {record['step']}: {summary}", flush=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
