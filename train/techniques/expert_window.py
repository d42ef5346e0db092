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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train.techniques.expert_health import layer_health


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
