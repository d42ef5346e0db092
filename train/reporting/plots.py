"""Plots of a training run from RUN_DIR/metrics.jsonl: loss curves, optimisation and throughput, expert load.
The run's figures are drawn here, the expert figures of an MoE run in `expert_plots`, and every PNG is
written by `figure_file.save`.

`make_report(run_dir, out)` writes PNGs (matplotlib's Agg backend, so no display is needed):

    loss.png                 cross-entropy overall and per source; load-balancing and z losses for MoE runs
    training.png             learning rate, gradient norm, tokens/s (and MFU when it was measured)
    expert_load_layer{i}.png for MoE runs: per MoE layer i (0-based among MoE layers), a heatmap of the
                             fraction of token copies each expert received, step by step; a perfectly
                             balanced layer is flat at 1/E
    expert_usage_by_source.png
                             for MoE runs that log `expert_load_by_source`: per MoE layer, a heatmap of
                             the share of each data source's token copies (rows, labelled) each expert
                             (columns) received, averaged over every logged step but the first (the
                             router as initialised; the only one when it is the only one), one colour
                             bar for all panels; a run with more than 12 MoE layers shows 12 evenly
                             spaced ones, first and last included, and says so in the title
    heldout.png              when records carry `eval/loss/<source>`: the held-out loss of each source
                             after the evaluated steps (`upcycler.train.loop.heldout_eval`); dashed, the
                             starting parameters' (`eval_start/loss/<source>`)
    goodput.png              when records carry `clock`: where the run's wall time went so far, as shares
                             stacked per category (`upcycler.train.reporting.goodput`), goodput on top
    expert_health.png        when records carry `expert_health` (`upcycler.train.techniques.expert_health`): one panel
                             per logged statistic (load_cv, dead, overload, entropy, bias_norm) over the
                             steps, a thin line per MoE layer (coloured by depth, viridis: first layer
                             dark, last yellow) and a bold line for the worst layer at each step (the
                             highest value; the lowest for entropy)

The report reads only the metrics log, so it works on a run in progress and on a copy of the log. The
log is read with `read_metrics` (every line checked; a torn last line of a killed run is ignored, any
other bad line is an error naming it) before anything is drawn, and the PNGs are rendered into a hidden
staging directory and moved into OUT only when all of them are done (`upcycler.train.outputs`), so a
failure leaves neither a partial set nor a stray directory.

What a log may ask to draw is bounded before anything is drawn, so that no number in it sizes the work or
the memory: at most `MAX_LAYERS` MoE layers (one PNG each), `MAX_EXPERTS` experts, `MAX_SOURCES` data
sources, and `MAX_USAGE_CELLS` layers × sources × experts; more is refused naming the step and the limit.
The usage mean is accumulated line by line (memory: one layers × sources × experts block, not one per step).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.staging import staged_files
from upcycler.locations import is_remote
from upcycler.train.reporting import expert_plots
from upcycler.train.reporting.figure_file import save
from upcycler.train.reporting.goodput import CATEGORIES
from upcycler.train.reporting.metrics import METRICS_FILE, read_metrics
from upcycler.train.techniques.expert_health import HEALTH_KEYS
from upcycler.untrusted import shown_path

MAX_LAYERS = 256  # MoE layers: one expert_load PNG each
MAX_EXPERTS = 4096
MAX_SOURCES = 256  # data sources: a line each in loss.png, a row each in expert_usage_by_source.png
MAX_USAGE_CELLS = 2**24  # layers × sources × experts of expert_usage_by_source (its mean: 8 bytes each)


def make_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write the report's PNGs into `out` (default RUN_DIR/report; a gs:// RUN_DIR needs a local `out`)
    and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    remote = is_remote(run_dir)
    if remote and out is None:
        raise UpcyclerError(f"{shown_path(run_dir)}: a run_dir in a bucket needs --out, a local directory for the "
                            "PNGs")
    run_dir = run_dir if remote else Path(run_dir)
    log = run_dir / METRICS_FILE
    if not remote and not os.path.lexists(log):
        raise UpcyclerError(f"{shown_path(log)}: missing; pass the run_dir of a continued-pretrain run")
    records = read_metrics(run_dir)
    if not records:
        raise UpcyclerError(f"{shown_path(log)}: no complete step yet; run at least one step first")
    _check_size(records, shown_path(log))
    health = expert_plots.health_series(records, shown_path(log))  # checked before anything is drawn
    usage = expert_plots.usage_by_source(records)
    out = Path(out) if out is not None else run_dir / "report"
    with staged_files(out, "--out") as stage:
        names = [_loss(records, stage / "loss.png"), _training(records, stage / "training.png")]
        if any(k.startswith("eval/loss/") for r in records for k in r):
            names.append(_heldout(records, stage / "heldout.png"))
        if any("clock" in r for r in records):
            names.append(_goodput(records, stage / "goodput.png"))
        names += expert_plots.expert_load(records, stage)
        if usage is not None:
            names.append(expert_plots.expert_usage_by_source(usage, stage / "expert_usage_by_source.png"))
        if health is not None:
            names.append(expert_plots.expert_health(*health, stage / "expert_health.png"))
    return [out / name for name in names]


def _check_size(records: Sequence[dict[str, Any]], log: str) -> None:
    """`UpcyclerError` naming the first step whose layers, experts or sources exceed what the report draws
    (`read_metrics` checked the shapes; every expert_load and expert_load_by_source line has one shape)."""
    fix = "the report draws no more; this is not a log the trainer wrote, fix or delete that line"
    names: set[str] = set()
    for r in records:
        where = f"{log}: step {r['step']}"
        names.update(k for k in r if k.startswith(("loss/", "eval/loss/")))
        if len(names) > MAX_SOURCES:
            raise UpcyclerError(f"{where}: more than {MAX_SOURCES:,} data sources have a loss/<source> or "
                                f"eval/loss/<source>; {fix}")
        load = r.get("expert_load")
        if load is not None and (len(load) > MAX_LAYERS or len(load[0]) > MAX_EXPERTS):
            raise UpcyclerError(f"{where}: expert_load covers {len(load):,} layers × {len(load[0]):,} experts, "
                                f"more than {MAX_LAYERS:,} × {MAX_EXPERTS:,}; {fix}")
        health = r.get("expert_health")
        layers = max((len(v) for k, v in health.items() if k in HEALTH_KEYS and isinstance(v, list)),
                     default=0) if isinstance(health, dict) else 0
        if layers > MAX_LAYERS:
            raise UpcyclerError(f"{where}: expert_health covers {layers:,} layers, more than {MAX_LAYERS:,}; "
                                f"{fix}")
        shares = r.get("expert_load_by_source")
        if shares is None:
            continue
        experts = next((len(row) for layer in shares for row in layer if row is not None), 0)
        sources = len(r["sources"])
        if len(shares) > MAX_LAYERS or sources > MAX_SOURCES or experts > MAX_EXPERTS \
                or len(shares) * sources * experts > MAX_USAGE_CELLS:
            raise UpcyclerError(f"{where}: expert_load_by_source covers {len(shares):,} layers × {sources:,} "
                                f"sources × {experts:,} experts, more than {MAX_LAYERS:,} layers, "
                                f"{MAX_SOURCES:,} sources, {MAX_EXPERTS:,} experts or {MAX_USAGE_CELLS:,} in all; "
                                f"{fix}")


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pairs)
    return np.asarray(steps), np.asarray(values, dtype=np.float64)


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or values.size < window:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def _loss(records: Sequence[dict[str, Any]], path: Path) -> str:
    import matplotlib.pyplot as plt

    window = max(1, len(records) // 50)
    router = any("lb_loss" in r for r in records)
    fig, axes = plt.subplots(1, 2 if router else 1, figsize=(12 if router else 7, 4.5), squeeze=False)
    ax = axes[0, 0]
    steps, loss = _series(records, "loss")
    ax.plot(steps, loss, color="black", alpha=0.25, lw=0.8)
    ax.plot(steps, _smooth(loss, window), color="black", lw=1.6, label="all sources")
    sources = sorted({k[5:] for r in records for k in r if k.startswith("loss/")})
    for name in sources:
        s, v = _series(records, f"loss/{name}")
        ax.plot(s, _smooth(v, window), lw=1.0, label=name.replace("$", r"\$"))  # no mathtext from the log
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if router:
        ax = axes[0, 1]
        for key, label in (("lb_loss", "load balancing (1 = balanced)"), ("z_loss", "router z-loss")):
            s, v = _series(records, key)
            ax.plot(s, _smooth(v, window), label=label)
        ax.set(xlabel="step", title="router losses")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, path)


def _training(records: Sequence[dict[str, Any]], path: Path) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(
        axes,
        ("lr", "grad_norm", "tokens_per_s"),
        ("learning rate", "gradient norm (before clipping)", "throughput"),
    ):
        s, v = _series(records, key)
        ax.plot(s, v, lw=1.0)
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
    s, mfu = _series(records, "mfu")
    if mfu.size:
        twin = axes[2].twinx()
        twin.plot(s, 100 * mfu, color="tab:red", lw=0.8, ls="--")
        twin.set_ylabel("MFU (%)", color="tab:red")
    axes[2].set_ylabel("tokens/s")
    return save(fig, path)


def _heldout(records: Sequence[dict[str, Any]], path: Path) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({k for r in records for k in r if k.startswith("eval/loss/")}):
        s, v = _series(records, key)
        line, = ax.plot(s, v, marker="o", ms=3, lw=1.0, label=key[len("eval/loss/"):].replace("$", r"\$"))
        start = next((r[f"eval_start/{key[len('eval/'):]}"] for r in records
                      if r.get(f"eval_start/{key[len('eval/'):]}") is not None), None)
        if start is not None:  # the starting parameters' loss: the baseline the curve is read against
            ax.axhline(start, color=line.get_color(), ls="--", lw=0.8)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="held-out loss per source")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def _goodput(records: Sequence[dict[str, Any]], path: Path) -> str:
    import matplotlib.pyplot as plt

    timed = [r for r in records if "clock" in r]
    steps = np.asarray([r["step"] for r in timed])
    totals = np.asarray([max(r["clock"]["total"], 1e-12) for r in timed])
    shares = [np.asarray([r["clock"][c] for r in timed]) / totals for c in CATEGORIES]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.stackplot(steps, shares, labels=CATEGORIES, alpha=0.85)
    ax.set(xlabel="step", ylabel="share of the run's wall time so far", ylim=(0, 1),
           title=f"goodput {100 * shares[0][-1]:.1f}% of {totals[-1] / 3600:.2f} h")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return save(fig, path)
