"""The MoE shapes worth proposing for a dense source: `dense-to-moe SRC --plan-for TOPOLOGY`.

A shape is routed experts N of width W, top-K, no shared experts (the width is any number of neurons:
`--expert-width`, exact). For each K of `TOPKS` the width is chosen so the active parameters per token
meet the target (default: the source's own, the least an exact upcycle has: the top-K experts' windows
must cover the dense MLP), rounded to `WIDTH_STEP` neurons (the TPU's lane width); N is what meets the
total-parameter target, else `SPARSITY`·K (one expert in eight active, the reference workload's 64 ×
top-8). Experts, top-k or width the user gives are kept. Every shape is a spec the writer would
produce (`choose_target`, the same checks as a real upcycle), so its compiled plan is the real one.
"""

from __future__ import annotations

from dataclasses import dataclass

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.transforms.dense_to_moe import DenseToMoE, cover_for
from upcycler.transforms.moe_target import MoERequest, choose_target

TOPKS = (2, 4, 8, 16)
SPARSITY = 8  # routed experts per active one when no total is asked for
WIDTH_STEP = 128


@dataclass(frozen=True)
class Shape:
    """One proposal: N experts of width W, top-K, and the spec it upcycles into."""

    experts: int
    topk: int
    width: int
    spec: ModelSpec

    def flags(self) -> str:
        return f"--experts {self.experts} --topk {self.topk} --expert-width {self.width}"


def shapes(source: ModelSpec, *, active: int | None = None, total: int | None = None, experts: int | None = None,
           topk: int | None = None, width: int | None = None) -> list[Shape]:
    """The proposals for `source` (see the module docstring), one per top-k that admits a shape; `experts`,
    `topk` and `width` fix what the user chose."""
    if source.moe is not None:
        raise UpcyclerError(f"--plan-for proposes MoE shapes for a dense source; this {source.family} model "
                            "is already MoE")
    ffn_per_neuron = 3 * source.hidden_size * source.num_layers  # gate, up and down of every layer
    shared = source.active_params() - ffn_per_neuron * source.intermediate_size
    want_active = active if active is not None else source.active_params()
    if want_active <= shared:
        raise UpcyclerError(f"--active-params {want_active:,} is not above the source's parameters outside its "
                            f"MLPs ({shared:,}): ask for more")
    found: list[Shape] = []
    refused: UpcyclerError | None = None
    too_wide = []  # the top-k whose experts would need more neurons than the dense MLP has
    for k in (topk,) if topk else TOPKS:
        w = width or round((want_active - shared) / (ffn_per_neuron * k) / WIDTH_STEP) * WIDTH_STEP
        if w > source.intermediate_size:
            too_wide.append(k)
            continue
        if w < 1:
            continue
        n = experts or (SPARSITY * k if total is None else max(k, round((total - shared) / (ffn_per_neuron * w))))
        n = n if experts else -(-n // k) * k  # a multiple of top-k: the virtual groups fill the experts
        try:
            cover_for(DenseToMoE(experts=n, topk=k, expert_width=w), source)
            target, _ = choose_target(source, MoERequest(n, k, w, 0, (), None, 1.0), "auto", allow_approximate=False)
        except UpcyclerError as err:
            refused = err  # a shape the writer refuses is not proposed
            continue
        found.append(Shape(n, k, w, target.spec))
    if not found and too_wide and refused is None and active is not None and width is None:
        k = max(too_wide)
        most = shared + ffn_per_neuron * k * source.intermediate_size
        raise UpcyclerError(f"--active-params {want_active:,} is above what this source can make active: at most "
                            f"{most:,} (top-{k} experts as wide as its whole MLP, {source.intermediate_size:,} "
                            "neurons); ask for less, or grow the source first (`upcycle depth`, or a wider model)")
    if not found:
        raise UpcyclerError("no exact MoE shape meets these targets (top-k experts must cover the dense MLP, so "
                            "the active parameters are at least the source's)"
                            + (f"; the closest was refused: {refused}" if refused else "")
                            + ": change --active-params, --total-params, --experts, --topk or --expert-width")
    return found
