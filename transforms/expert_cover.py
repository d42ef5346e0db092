"""Which neurons of a dense FFN each routed expert holds, and the `down_proj` scale that keeps the sum exact.

The dense FFN's F neurons split into a shared part [0, Fs) (the shared experts, S of width w) and a
routed part [Fs, F) of Fr neurons. The routed experts form virtual groups of R experts with identical
router rows (upcycling-math §1), so top-k always picks whole groups and each chosen member gets 1/R of
the group's weight. Member j of a group holds a *window* of w routed neurons starting at
⌊j·Fr/R⌋, read cyclically: with R·w = Fr the windows tile the routed part (the `--granularity` case);
with R·w > Fr consecutive windows overlap and the last wraps around to the first neurons.

Neuron n is then held by c_n members. Scaling its `down_proj` column by R/c_n (times the router's own
correction) gives Σ_members (1/R)·(R/c_n)·h_n·d_n = h_n·d_n: the function is preserved for any width
with R·w ≥ Fr. The starts are an arithmetic progression of step Fr/R, so every window of w neurons holds
⌊R·w/Fr⌋ or ⌈R·w/Fr⌉ starts: the c_n differ by at most one (as even a cover as there is). When every
scale is a power of two the scaled weights are exact in any float format; otherwise they round once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import gcd, log2

import numpy as np

from upcycler.errors import UpcyclerError


@dataclass(frozen=True)
class Cover:
    """Shared neurons [0, shared), and R windows of `width` routed neurons per virtual group."""

    intermediate: int  # F
    shared: int  # Fs: neurons of the shared experts
    width: int  # w: neurons per routed expert
    group: int  # R: experts per virtual group (identical router rows)

    @property
    def routed(self) -> int:
        """Fr = F − Fs: the neurons the routed experts share out."""
        return self.intermediate - self.shared

    def start(self, j: int) -> int:
        """First routed neuron (offset into the routed part) of group member j."""
        return j * self.routed // self.group

    def contiguous(self, j: int) -> slice | None:
        """The dense-FFN neurons of group member j as a slice, or None when its window wraps around (known
        from the start alone: nothing is allocated by the width)."""
        s = self.start(j)
        return slice(self.shared + s, self.shared + s + self.width) if s + self.width <= self.routed else None

    def window(self, j: int) -> slice | np.ndarray:
        """The dense-FFN neurons of group member j: a slice, or indices when the window wraps around."""
        s = self.start(j)
        if s + self.width <= self.routed:
            return slice(self.shared + s, self.shared + s + self.width)
        return self.shared + (s + np.arange(self.width)) % self.routed

    @cached_property
    def _runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Where c_n changes: the routed offsets that start a run of equal counts (ascending, the first 0)
        and the count of each run. R windows start or end at most 2R + 1 runs, so the counts are known
        from the cover's shape alone, with no entry per neuron (a dry run plans without allocating by F)."""
        deltas: dict[int, int] = {0: 0}
        for j in range(self.group):
            s, e = self.start(j), self.start(j) + self.width
            deltas[s] = deltas.get(s, 0) + 1
            if e > self.routed:  # wraps around to the first neurons
                deltas[0] += 1
                e -= self.routed
            deltas[e] = deltas.get(e, 0) - 1
        starts = sorted(p for p in deltas if p < self.routed)
        counts = np.cumsum([deltas[p] for p in starts])
        return np.asarray(starts, np.int64), counts.astype(np.int64)

    def held(self, offsets: np.ndarray) -> np.ndarray:
        """c_n of the routed neurons at `offsets` (into the routed part): how many members hold each (≥ 1)."""
        starts, counts = self._runs
        return counts[np.searchsorted(starts, offsets, side="right") - 1]

    @property
    def counts(self) -> np.ndarray:
        """c_n for every routed neuron (one entry per neuron: for checks on small covers)."""
        return self.held(np.arange(self.routed))

    def distinct_counts(self) -> list[int]:
        """The distinct c_n, ascending (from the runs: no entry per neuron)."""
        return sorted(set(self._runs[1].tolist()))

    def column_scales(self, j: int, factor: float) -> np.ndarray:
        """Per-neuron `down_proj` scale of member j: `factor` (the router's correction, R for a renormalising
        router) divided by how many members hold the neuron."""
        held = self.held((self.start(j) + np.arange(self.width)) % self.routed)
        return factor / held.astype(np.float64)

    def scales(self, factor: float) -> list[float]:
        """The distinct down_proj scales used, ascending."""
        return sorted({factor / c for c in self.distinct_counts()})

    @property
    def overlap(self) -> int:
        """Neurons held more than once per group, counted with multiplicity: R·w − Fr."""
        return self.group * self.width - self.routed

    def describe(self, factor: float) -> str:
        """One line: groups, windows, overlap and the down_proj scales, with their exactness."""
        if not self.overlap:
            return (f"{self.group} experts per virtual group tile the {self.routed} routed neurons in windows "
                    f"of {self.width}")
        counts = self.distinct_counts()
        scales = ", ".join(f"{s:g}" for s in self.scales(factor))
        return (f"{self.group} experts per virtual group hold overlapping windows of {self.width} of the "
                f"{self.routed} routed neurons ({self.overlap} held twice or more; each neuron held by "
                f"{' or '.join(map(str, counts))} experts), so routed down_proj columns are scaled by "
                f"{scales}")


def powers_of_two(values: list[float]) -> bool:
    """True when every value is an exact power of two (scaling by it is exact in any float format)."""
    return all(v > 0 and log2(v).is_integer() for v in values)


def tiled(F: int, granularity: int, shared_shards: int) -> Cover:
    """The divisible case: G shards of width F/G, the first S shared, R = G − S routed, no overlap."""
    width = F // granularity
    return Cover(F, shared_shards * width, width, granularity - shared_shards)


def overlapping(F: int, width: int, shared_experts: int, experts: int, topk: int) -> Cover:
    """The cover for `--expert-width w`: the smallest group R (dividing both N and K, so groups fill the
    experts and top-k picks whole groups) whose R windows reach every routed neuron (R·w ≥ Fr)."""
    shared = shared_experts * width
    if width > F:
        raise UpcyclerError(f"--expert-width {width} is wider than the dense FFN ({F} neurons); choose at most {F}")
    if shared >= F:
        raise UpcyclerError(f"--shared-experts {shared_experts} × --expert-width {width} = {shared} neurons "
                            f"leave none of the {F} for the routed experts; use fewer shared experts")
    routed = F - shared
    if width > routed:
        raise UpcyclerError(f"--expert-width {width} is wider than the {routed} routed neurons (F = {F} minus "
                            f"{shared} shared); choose at most {routed}")
    common = gcd(experts, topk)
    for group in range(1, common + 1):
        if common % group == 0 and group * width >= routed:
            return Cover(F, shared, width, group)
    largest = max(d for d in range(1, common + 1) if common % d == 0)
    narrowest = -(-routed // largest)
    raise UpcyclerError(f"--expert-width {width} is too narrow: a virtual group can have at most {largest} "
                        f"experts (a divisor of --experts {experts} and --topk {topk}), and {largest} × {width} "
                        f"< {routed} routed neurons; choose --expert-width {narrowest} or more")
