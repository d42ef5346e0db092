"""Router rows that send each source's tokens to the experts cut from that source (`--router-init centroids`).

For MoE layer i let c_s be the mean router input (the FFN's normalised input) of source s's own model on
source s's calibration data, and c̄ their mean over the sources. Hidden states share a large common
direction, so each row uses the part of its source's centroid that tells the sources apart:

    u_s = (c_s − c̄) with its component along c̄ removed,   row(group g) = a · u_s / ‖u_s‖ + random row g

Removing c̄ makes the centroid of the mean token score 0 on every row; on the calibration means, source s
then prefers its own row by c_s·(û_s − û_t) > 0 for every other source t (unless two centroids point the
same way). The gain `a` makes that preference `margin` logits on average over the sources. The random
rows of `--router-std` stay on top: they break the tie between the groups of one source (which would
otherwise train identically forever), and the R experts of a virtual group still share one row.

The means come from the JAX model (the `router_inputs` of the transform's context,
`upcycler.train.evaluation.calibration`), computed on first use, once for all layers, and shared by every
layer's router.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.tensors import LazyTensor
from upcycler.transforms.experts_from import Sources
from upcycler.transforms.registry import RouterInputsService


class RouterCalibration:
    """The centroid directions of every MoE layer, computed once from the sources' calibration data."""

    def __init__(self, sources: Sources, layers: Sequence[int], data: Path, sequences: int, length: int,
                 margin: float, measure: RouterInputsService):
        self.sources, self.layers, self.data = sources, tuple(layers), data
        self.sequences, self.length, self.margin, self.measure = sequences, length, margin, measure
        self._rows: dict[int, np.ndarray] | None = None
        self._lock = threading.Lock()

    def rows(self, layer: int) -> np.ndarray:
        """[sources, D] float64: a · û_s for MoE layer `layer` (see the module docstring)."""
        with self._lock:
            if self._rows is None:
                means = np.stack([self.measure.mean(c, self.data, n, self.sequences, self.length, self.layers)
                                  for n, c in zip(self.sources.names, self.sources.checkpoints)], axis=1)
                self._rows = {layer: self._directions(layer, m) for layer, m in zip(self.layers, means)}
            return self._rows[layer]

    def _directions(self, layer: int, centroids: np.ndarray) -> np.ndarray:
        """a · û_s from the centroids [S, D] of one layer."""
        mean = centroids.mean(0)
        along = mean / max(np.linalg.norm(mean), np.finfo(np.float64).tiny)
        u = centroids - mean
        u -= np.outer(u @ along, along)
        norms = np.linalg.norm(u, axis=1)
        if np.any(norms <= 1e-12 * max(np.linalg.norm(mean), 1.0)):
            name = self.sources.names[int(np.argmin(norms))]
            raise UpcyclerError(f"--router-init centroids: at layer {layer} the calibration data of {name} "
                                "gives the same mean router input as the other sources' together; use data "
                                "that differs by source, or --router-init random")
        unit = u / norms[:, None]
        scores = centroids @ unit.T  # [s, t]: source s's mean on source t's direction
        others = np.where(np.eye(len(unit), dtype=bool), -np.inf, scores).max(1)
        preference = float(np.mean(np.diag(scores) - others))
        if preference <= 0:
            raise UpcyclerError(f"--router-init centroids: at layer {layer} the sources' calibration data does "
                                "not separate (each source's mean prefers another source's row); use data "
                                "that differs by source, or --router-init random")
        return unit * (self.margin / preference)


def centroid_router(calibration: RouterCalibration, layer: int, random_rows: LazyTensor, group: int) -> LazyTensor:
    """[E, D] router of `layer`: each group's random row plus the centroid row of the group's source, summed
    in fp32 and cast once to the router's dtype (the R rows of a group stay bitwise identical)."""
    sources = np.asarray(calibration.sources.expert_source)

    def load() -> np.ndarray:
        base = random_rows.load()
        centroid = calibration.rows(layer)[sources].astype(np.float32)
        return (base.astype(np.float32) + centroid).astype(base.dtype)

    assert len(sources) == random_rows.shape[0] and len(sources) % group == 0
    return LazyTensor(random_rows.shape, random_rows.dtype, load)
