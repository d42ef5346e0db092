"""A roofline estimate of one train step on one chip: the time its compute, HBM traffic and interconnect
traffic each need at the chip's published peak rates, the step time if they overlapped perfectly, and the
MFU that step time allows.

The three times are lower bounds, and so is their maximum (perfect overlap); the MFU it gives is an upper
bound on what the run can reach. The model FLOPs are analytic (6 · active parameters per token plus
attention, computed elsewhere), never the compiler's cost analysis: XLA's count for TPU treats a
`lax.ragged_dot` as a dense product over every expert, which would credit an MoE with work it does not do.
The executed FLOPs, which set the compute time, may include what the model FLOPs leave out (rematerialised
forward passes, the optimiser). Communication time is the bytes a chip receives (`collectives`) over the
bandwidth its links can bring in at once, half the published bidirectional figure
(`Chip.ici_ingress_bandwidth`): also a bound, as a collective along one mesh axis uses only some links.
"""

from __future__ import annotations

from dataclasses import dataclass

from upcycler.hardware import Chip

TERMS = ("compute", "memory", "communication")


@dataclass(frozen=True)
class Roofline:
    """Per-chip times of one step in seconds, the term that bounds it, and the MFU bound."""

    chip: str
    compute_s: float
    memory_s: float
    communication_s: float
    step_s: float  # max of the three: the step time with perfect overlap
    bound: str  # which of TERMS sets step_s (the first of them on a tie)
    model_flops: float
    mfu: float  # model_flops / (step_s · peak); 0 for an empty step

    @property
    def times(self) -> dict[str, float]:
        """The three times by term, in TERMS order."""
        return {"compute": self.compute_s, "memory": self.memory_s, "communication": self.communication_s}


def estimate(
    model_flops: float,
    executed_flops: float,
    hbm_bytes: float,
    collective_traffic_bytes: float,
    chip: Chip,
) -> Roofline:
    """The roofline of a step that, on one chip, counts `model_flops` of model work (analytic), executes
    `executed_flops`, moves `hbm_bytes` through HBM and receives `collective_traffic_bytes` over the
    interconnect. `chip` holds the figures of one device (see `Chip.per_device`). Raises ValueError for a
    negative amount."""
    amounts = {
        "model_flops": model_flops,
        "executed_flops": executed_flops,
        "hbm_bytes": hbm_bytes,
        "collective_traffic_bytes": collective_traffic_bytes,
    }
    for name, value in amounts.items():
        if not value >= 0:
            raise ValueError(f"{name} must be a non-negative number, got {value}")
    times = {
        "compute": executed_flops / chip.peak_bf16_flops,
        "memory": hbm_bytes / chip.hbm_bandwidth,
        "communication": collective_traffic_bytes / chip.ici_ingress_bandwidth,
    }
    bound = max(TERMS, key=lambda t: (times[t], -TERMS.index(t)))
    step = times[bound]
    mfu = model_flops / (step * chip.peak_bf16_flops) if step > 0 else 0.0
    return Roofline(
        chip=chip.name,
        compute_s=times["compute"],
        memory_s=times["memory"],
        communication_s=times["communication"],
        step_s=step,
        bound=bound,
        model_flops=model_flops,
        mfu=mfu,
    )
