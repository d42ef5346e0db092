"""The report's expert figures of an MoE run (`plots.make_report` draws them): expert load per layer over
the steps, each data source's share of every expert, and the experts' health statistics per layer.
What each PNG shows is in `plots`'s docstring; the sizes a log may ask for are bounded there first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.reporting.figure_file import save
from upcycler.train.techniques.expert_health import HEALTH_KEYS, check_logged_health


def expert_load(records: Sequence[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    loads = [  # read_metrics checked every expert_load is a rectangle of one shape
        (r["step"], np.asarray(r["expert_load"], dtype=np.float64)) for r in records if "expert_load" in r
    ]
    if not loads:
        return []
    steps = np.asarray([s for s, _ in loads])
    stacked = np.stack([x for _, x in loads])  # [T, M, E]
    paths = []
    for layer in range(stacked.shape[1]):
        grid = stacked[:, layer, :].T  # [E, T]
        fig, ax = plt.subplots(figsize=(10, min(60.0, max(3.0, 0.12 * grid.shape[0] + 1.5))))
        image = ax.imshow(
            grid,
            aspect="auto",
            origin="lower",
            interpolation="nearest",
            cmap="viridis",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, grid.shape[0] - 0.5),
        )
        fig.colorbar(image, ax=ax, label=f"share of token copies (balanced = {1 / grid.shape[0]:.3g})")
        ax.set(xlabel="step", ylabel="expert", title=f"expert load, MoE layer {layer}")
        paths.append(save(fig, out / f"expert_load_layer{layer}.png"))
    return paths


MAX_USAGE_PANELS = 12


@dataclass(frozen=True)
class SourceUsage:
    """What `expert_usage_by_source.png` draws: `shares` [M, S, E], the mean over the logged `steps` of
    each source's expert shares (a source's null rows skipped; NaN for a source without a token in any
    of them), rows named by `sources`."""

    sources: list[str]
    shares: np.ndarray
    steps: list[int]


def usage_by_source(records: Sequence[dict[str, Any]]) -> SourceUsage | None:
    """The mean `expert_load_by_source` over every record that logged it but the first (the routing of
    the starting weights), or over that one when it is alone, each step weighing the same; None when no
    record has it or every row is null. `read_metrics` checked one shape and one `sources` on every line."""
    logged = [r for r in records if "expert_load_by_source" in r]
    averaged = logged[1:] or logged
    experts = next((len(row) for r in averaged for layer in r["expert_load_by_source"] for row in layer
                    if row is not None), None)
    if experts is None:
        return None
    first = averaged[0]["expert_load_by_source"]
    total = np.zeros((len(first), len(first[0]), experts))  # [M, S, E], summed line by line
    count = np.zeros((len(first), len(first[0]), 1))
    for r in averaged:
        for m, layer in enumerate(r["expert_load_by_source"]):
            for s, row in enumerate(layer):
                if row is not None:
                    total[m, s] += row
                    count[m, s] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return SourceUsage(list(averaged[0]["sources"]), mean, [r["step"] for r in averaged])


def usage_layers(num_layers: int, most: int = MAX_USAGE_PANELS) -> list[int]:
    """The MoE layers to draw: all of them, or `most` evenly spaced ones with the first and the last."""
    if num_layers <= most:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (most - 1)) for i in range(most)})


def expert_usage_by_source(usage: SourceUsage, path: Path) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    num_layers, num_sources, num_experts = usage.shares.shape
    layers = usage_layers(num_layers)
    cols = min(4 if num_experts <= 16 else 3 if num_experts <= 32 else 2, len(layers))
    rows = -(-len(layers) // cols)
    panel_w = min(9.0, max(3.0, 0.16 * num_experts + 1.6))
    panel_h = min(6.0, max(1.8, 0.32 * num_sources + 1.2))
    fig = plt.figure(figsize=(cols * panel_w + 1.2, rows * panel_h + 0.9))
    grid = fig.add_gridspec(rows, cols + 1, width_ratios=[1.0] * cols + [0.04])
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")  # a source without tokens: grey
    top = float(np.nanmax(usage.shares))
    unseen = np.isnan(usage.shares).all(axis=(0, 2))  # [S]
    labels = [name.replace("$", r"\$") + (" (no tokens)" if none else "")  # no mathtext from the log
              for name, none in zip(usage.sources, unseen)]
    image = None
    for n, layer in enumerate(layers):
        ax = fig.add_subplot(grid[n // cols, n % cols])
        image = ax.imshow(usage.shares[layer], aspect="auto", interpolation="nearest", cmap=cmap,
                          vmin=0.0, vmax=top if top > 0 else 1.0)
        ax.set_yticks(range(num_sources), labels if n % cols == 0 else [""] * num_sources, fontsize=8)
        ax.set_title(f"MoE layer {layer}", fontsize=9)
        ax.set_xlabel("expert", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, cax=fig.add_subplot(grid[:, -1]), label="share of the source's token copies")
    steps = usage.steps
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]} ({len(steps)} logged)"
    shown = "" if len(layers) == num_layers else f"; {len(layers)} of {num_layers} MoE layers, evenly spaced"
    fig.suptitle(f"expert usage by data source, mean over {span}{shown}", fontsize=10)
    return save(fig, path)


_HEALTH_PANELS = (  # key, title, whether a low value is the bad one
    ("load_cv", "load CV (std / mean of counts; 0 = balanced)", False),
    ("dead", "dead experts", False),
    ("overload", "overload (max count / fair share)", False),
    ("entropy", "router entropy (nats/token)", True),
    ("bias_norm", "selection-bias L2 norm", False),
)


def health_series(
    records: Sequence[dict[str, Any]], log: str
) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """The steps [T] that logged `expert_health` and, per statistic present, its values [T, M] (NaN
    where a step lacks it or logged null); None when no record has it. Every `expert_health` is checked
    (`check_logged_health`) and must cover as many layers as the first one."""
    logged = [r for r in records if "expert_health" in r]
    first: tuple[int, int] | None = None  # (layers, step)
    logged = [r for r in logged if any(key in r["expert_health"] for key in HEALTH_KEYS)]
    for r in logged:
        where = f"{log}: step {r['step']}"
        health = check_logged_health(r["expert_health"], where)  # its lists are of one length
        layers = next((len(health[key]) for key in HEALTH_KEYS if key in health), None)
        if layers is None:
            continue
        if first is None:
            first = (layers, r["step"])
        elif layers != first[0]:
            raise UpcyclerError(f"{where}: expert_health covers {layers} layers, but step {first[1]} covers "
                                f"{first[0]}; fix or delete that line")
    if first is None:
        return None
    nulls = [None] * first[0]
    series = {
        key: np.asarray([[np.nan if v is None else v for v in r["expert_health"].get(key, nulls)]
                         for r in logged], dtype=np.float64)
        for key, _, _ in _HEALTH_PANELS
        if any(key in r["expert_health"] for r in logged)
    }
    return (np.asarray([r["step"] for r in logged]), series) if series else None


def expert_health(steps: np.ndarray, series: dict[str, np.ndarray], path: Path) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [p for p in _HEALTH_PANELS if p[0] in series]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    layers = next(iter(series.values())).shape[1]
    colours = plt.get_cmap("viridis")(np.linspace(0, 1, layers))
    for ax, (key, title, low_is_bad) in zip(axes.flat, panels):
        values = series[key]  # [T, M]
        for layer in range(layers):
            ax.plot(steps, values[:, layer], color=colours[layer], lw=0.8, alpha=0.7,
                    label=f"MoE layer {layer}" if layers <= 8 or layer in (0, layers - 1) else None)
        worst = (np.fmin if low_is_bad else np.fmax).reduce(values, axis=1)  # NaN only if all are
        ax.plot(steps, worst, color="black", lw=1.8, label="worst layer")
        ax.set(xlabel="step", title=title)
        if key == "dead":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save(fig, path)
