"""The expert window: the train step's expert counts summed over the steps of one window, and turned
into a metrics record's `expert_load`, `expert_load_by_source` and `expert_health`.

The trainer adds every step's host metrics (`ExpertWindow.add`) and takes the window on the step where it
ends (`take`: the record's fields, the health figures from `expert_health.layer_health`, and a new
window). Windows start at multiples of `metrics.expert_load_every` and end on the step before the next
one (or at the run's last step); a checkpoint saves the open window (`state`, its meta's
`expert_window`) and the resumed run reopens it (`restore`, checked), so it logs exactly what it would
have uninterrupted. The fields' format is `upcycler.train.reporting.metrics`.

What this module preserves: nothing is sampled (every step's counts are in its window); a window crosses a
checkpoint exactly (integer counts and float sums, exact in JSON); each layer's (and each source's) row
of shares sums to 1 before it is rounded to 6 decimals.

`ExpertWatch` is the technique on the loop (`upcycler.train.techniques.protocol`): it feeds the window,
puts it on the record of the step where it ends (and its health summary on the progress line), and with
`metrics.stop_on_collapse` stops the run once that record is written if a layer has collapsed
(`expert_health.collapsed_layers`), naming the layer and the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train.config import MetricsConfig
from upcycler.train.techniques.expert_health import collapsed_layers, layer_health, moe_layer_numbers, summary
from upcycler.train.techniques.protocol import MetaEntries, StepContext, Technique


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
        self.layers = len(moe_layer_numbers(spec))  # M (0 for a dense model)
        self.experts = spec.moe.num_experts if spec.moe is not None else 0  # E
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

    def restore(self, meta: MetaEntries, key: str = "expert_window") -> None:
        """Reopen a window saved by `state` (a checkpoint's meta entry `key`), checked against this run: its
        counts [MoE layers × experts], entropies [MoE layers], counts by source [MoE layers × sources ×
        experts] and biases [MoE layers × experts]; anything else is refused in one line (`meta.refuse`)."""
        state = meta.get(key, {})
        if not isinstance(state, dict):
            raise meta.refuse(key, "is not an open window (an object)")
        if not state:
            return
        if self.layers == 0:
            raise meta.refuse(key, "holds expert counts, and this model has no MoE layer")
        unknown = sorted(set(state) - {"steps", "counts", "entropy", "by_source", "bias"})
        if unknown or "counts" not in state or "entropy" not in state:
            raise meta.refuse(key, f"is not an open window (fields {sorted(map(str, state))[:8]})")
        M, E, S = self.layers, self.experts, len(self.sources)
        steps = meta.count(state.get("steps"), f"{key}.steps", low=1, high=max(meta.step, 1))
        counts = meta.array(state["counts"], f"{key}.counts", (M, E), "MoE layers × experts", counts=True)
        entropy = meta.array(state["entropy"], f"{key}.entropy", (M,), "MoE layers")
        by_source = bias = None
        if "by_source" in state:
            by_source = meta.array(state["by_source"], f"{key}.by_source", (M, S, E),
                                   "MoE layers × sources × experts", counts=True)
        if "bias" in state:
            bias = meta.array(state["bias"], f"{key}.bias", (M, E), "MoE layers × experts")
        self._steps, self._counts, self._entropy, self._by_source, self._bias = steps, counts, entropy, by_source, bias


class ExpertWatch(Technique):
    """The expert window of a run and its health (see the module docstring); the open window is its entry
    of a checkpoint's meta (`expert_window`)."""

    meta_keys = ("expert_window",)

    def __init__(self, spec: ModelSpec, metrics: MetricsConfig, steps: int, sources: Sequence[str] = ()):
        self.window = ExpertWindow(spec, metrics.dead_below, sources)
        self.spec, self.layers = spec, moe_layer_numbers(spec)
        self.every, self.steps, self.stop_on_collapse = metrics.expert_load_every, steps, metrics.stop_on_collapse
        self._health: dict[str, Any] | None = None

    def after_step(self, ctx: StepContext) -> None:
        """Add the step to the window; where a window ends (windows start at multiples of `every`), its
        fields go on the record and its health on the progress line."""
        self.window.add(ctx.raw)
        ends = (ctx.step + 1) % self.every == 0 or ctx.step + 1 == self.steps
        window = self.window.take() if ends else None
        if window:
            ctx.record.update(window)
        self._health = (window or {}).get("expert_health")
        if self._health:
            ctx.progress = summary(self._health, self.layers)

    def after_write(self, ctx: StepContext) -> None:
        """`metrics.stop_on_collapse`: stop when a layer has lost at least half its experts in this window."""
        health, self._health = self._health, None
        if not (health and self.stop_on_collapse and ctx.discarded is None):
            return
        num_experts = self.spec.moe.num_experts  # type: ignore[union-attr]
        collapsed = collapsed_layers(health, num_experts)
        if not collapsed:
            return
        m, last = collapsed[0], ctx.last_checkpoint
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        raise UpcyclerError(
            f"expert collapse at step {ctx.step}: MoE layer {self.layers[m]} has {health['dead'][m]} of "
            f"{num_experts} experts dead (load_cv {health['load_cv'][m]:.2f}); stopped; {where}; "
            "raise loss.lb_coef or loss.bias_update_rate, or lower optimizer.lr, then resume"
        )

    def state(self) -> dict[str, Any]:
        return {"expert_window": self.window.state()}

    def restore(self, meta: MetaEntries) -> None:
        self.window.restore(meta)
