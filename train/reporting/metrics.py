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
    step_time, tokens_per_s   wall time of the step and B·L / step_time
    mfu             model FLOPs utilisation against `metrics.peak_flops` per device (only when set)
    expert_load     per MoE layer, the fraction of token copies each expert received (every
                    `metrics.expert_load_every` steps); sums to 1 per layer
    expert_load_by_source, sources
                    on expert_load's lines and, like it, of that one step: per MoE layer, per data source,
                    the fraction of that source's token copies each expert received ([layers][sources]
                    [experts]; each row sums to 1, or is null when the step had no token of that source),
                    and `sources`, the data sources' names in the order of the rows
    expert_health   per MoE layer over a window of `metrics.expert_load_every` steps, on the window's
                    last step (windows start at multiples of it, so a run resumed from a checkpoint at
                    such a step logs what it would have uninterrupted): load_min, load_max, load_cv,
                    dead, overload, entropy, bias_norm (`upcycler.train.techniques.expert_health`)
    spike           on a step the loss-spike guard caught: {action, median, averaged} (`spike_guard`)

A resumed run first drops the lines of steps at or after its start step (they were not checkpointed), so
the log always describes one uninterrupted trajectory. A value that is not finite is written as null.

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
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.layout import declare_params
from upcycler.locations import is_remote
from upcycler.spec import ModelSpec
from upcycler.train.reporting import metrics_objects
from upcycler.train.techniques.expert_health import MAX_MAGNITUDE, check_logged_health, layer_health
from upcycler.untrusted import MAX_JSON_BYTES, describe, integer, open_regular, parse_json, real, shown_path

METRICS_FILE = "metrics.jsonl"
NUMBER_FIELDS = (
    "loss", "lb_loss", "z_loss", "total_loss", "grad_norm", "lr", "tokens", "step_time", "tokens_per_s", "mfu"
)
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
    trainer says a checkpoint was saved (`saved`) and at `close` (`metrics_objects`)."""

    def __init__(self, run_dir: Path, *, enabled: bool, start_step: int):
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self._file: TextIO | None = None
        self._pending: tuple[list[int], list[str]] | None = None  # bucket run_dir: (steps, lines) not written
        if enabled and is_remote(run_dir):
            metrics_objects.truncate_from(run_dir, start_step)
            self._pending = ([], [])
        elif enabled:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                _truncate_from(self.path, start_step)
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
        """A checkpoint was saved: in a bucket run_dir, write the lines since the previous one."""
        if self._pending is not None:
            metrics_objects.write_interval(self.run_dir, *self._pending)
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
    with_load: bool,
    health: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON record of one step from the train step's (host) metric arrays (and the expert health of
    the window that ends here, when given)."""
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
    if with_load and "expert_counts" in raw:
        counts = np.asarray(raw["expert_counts"], dtype=np.float64)
        totals = np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
        rec["expert_load"] = np.round(counts / totals, 6).tolist()
    if with_load and "expert_counts_by_source" in raw:
        rec["expert_load_by_source"] = source_shares(raw["expert_counts_by_source"])
        rec["sources"] = list(sources)
    if health is not None:
        rec["expert_health"] = dict(health)
    return rec


def source_shares(counts_MSE: Any) -> list[list[list[float] | None]]:
    """`expert_load_by_source` from per-source counts [M, S, E]: each (layer, source) row divided by its
    sum and rounded to 6 decimals (as `expert_load`), so it sums to 1; None for a source without tokens."""
    counts = np.asarray(counts_MSE, dtype=np.float64)
    totals = counts.sum(axis=2, keepdims=True)
    shares = np.round(counts / np.where(totals > 0, totals, 1.0), 6)
    return [[row.tolist() if total > 0 else None for row, total in zip(layer, layer_totals[:, 0])]
            for layer, layer_totals in zip(shares, totals)]


class ExpertWindow:
    """Token copies per expert, router entropy and selection bias over the steps since the last health
    record; `take` turns them into `expert_health` statistics and starts a new window."""

    def __init__(self, spec: ModelSpec, dead_below: float):
        self.top_k = spec.moe.top_k if spec.moe is not None else 1  # unused for a dense model: no counts
        self.dead_below = dead_below
        self._counts: np.ndarray | None = None
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
        self._steps += 1
        if "selection_bias" in raw:
            self._bias = np.asarray(raw["selection_bias"], np.float64)

    def take(self) -> dict[str, list] | None:
        """The window's health statistics (None before any MoE step), and an empty window."""
        if self._counts is None:
            return None
        health = layer_health(self._counts, self.top_k, self.dead_below, self._entropy / self._steps, self._bias)
        self._counts = self._entropy = None
        self._steps = 0
        return health


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

    `step` is a non-negative integer; the fields of `NUMBER_FIELDS` and `loss/<source>` are finite
    numbers or null; `expert_load` is a non-empty rectangle of finite numbers (layers × experts);
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
        if key.startswith("loss/"):
            _check_name(key[5:], "the source of a loss/<source> field", where)
        if (key in NUMBER_FIELDS or key.startswith("loss/")) and value is not None:
            real(value, key, where, low=-MAX_MAGNITUDE, high=MAX_MAGNITUDE, fix=_FIX)
    if "expert_load" in record:
        _check_load(record["expert_load"], where)
    if "sources" in record:
        _check_sources(record["sources"], where)
    if "expert_load_by_source" in record:
        _check_load_by_source(record, where)
    if "expert_health" in record:
        check_logged_health(record["expert_health"], where, fix=_FIX)
    return record


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


def _truncate_from(path: Path, start_step: int) -> None:
    """Keep only the complete records of steps before `start_step` (the file is replaced atomically)."""
    if not os.path.lexists(path):
        return
    kept = [r for r in read_metrics(path.parent) if r["step"] < start_step] if start_step > 0 else []
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
