"""Expert health of an MoE run: how evenly each MoE layer's router spreads tokens over its experts.

Host-side and pure (numpy on arrays already fetched from the devices). The trainer sums the train step's
`expert_counts` [M, E] over a window of `metrics.expert_load_every` steps (`expert_window`), which calls
`layer_health`; the result goes into the step's metrics record as `expert_health` (each value a list over
the M MoE layers), `summary` gives the progress line and `collapsed_layers` the layers to warn (or stop)
about.

Layers are indexed 0..M-1 among the MoE layers, as in `expert_load`; `moe_layer_numbers(spec)` maps
those indices to the model's own decoder layer numbers for messages.

Definitions, per MoE layer, from the counts c_1..c_E of token copies each routed expert received (a token
routed to top_k experts counts once for each), with total T = Σ c_e and fair share F = T / E:

    load_min, load_max  min_e c_e / T and max_e c_e / T: the smallest and largest fraction of the layer's
                        copies one expert received; a balanced layer has both at 1/E, and load_max can
                        reach at most 1/top_k (an expert sees each token at most once)
    load_cv             coefficient of variation of the counts: population std of c / mean of c;
                        0 when balanced, √(E/top_k − 1) when the router always picks the same top_k
    dead                number of experts with c_e < dead_below · F (strictly below; dead_below = 0
                        declares nothing dead)
    overload            max_e c_e / F = E · load_max: 1 when balanced, at most E / top_k
    entropy             (when given) the router's mean per-token entropy in nats, passed through;
                        ln E for a uniform router, 0 for a one-hot one
    bias_norm           (when given) the L2 norm of the layer's selection-bias row (aux-loss-free
                        balancing moves it; a growing norm means the bias fights the router)

A layer that received no token (T = 0) has load_min = load_max = load_cv = overload = 0 and dead = 0.
A layer is *collapsed* when at least half of its routed experts are dead (`collapsed_layers`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.untrusted import describe, real

HEALTH_KEYS = ("load_min", "load_max", "load_cv", "dead", "overload", "entropy", "bias_norm")
MAX_MAGNITUDE = 1e300  # a logged number beyond this cannot be plotted (the axis range overflows)


def layer_health(
    counts_ME: np.ndarray,
    top_k: int,
    dead_below: float,
    entropy_M: np.ndarray | None = None,
    bias_ME: np.ndarray | None = None,
) -> dict[str, list]:
    """The statistics of the module docstring for each of the M layers of `counts_ME` [M, E].

    Values are plain Python floats (`dead`: ints) so the dict goes into JSON as it is; `entropy` and
    `bias_norm` are present only when `entropy_M` [M] and `bias_ME` [M, E] are given. Raises ValueError
    for counts that are not a non-empty [M, E] array of finite non-negative numbers, top_k outside
    1..E, a negative dead_below, or an entropy/bias of another shape."""
    counts = _counts(counts_ME)
    num_experts = counts.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and {num_experts} (the experts), not {top_k}")
    if not dead_below >= 0:
        raise ValueError(f"dead_below must be a non-negative number, not {dead_below}")
    total = counts.sum(axis=1)
    some = total > 0
    safe_total = np.where(some, total, 1.0)
    fair = total / num_experts
    health: dict[str, list] = {
        "load_min": (counts.min(axis=1) / safe_total).tolist(),
        "load_max": (counts.max(axis=1) / safe_total).tolist(),
        "load_cv": np.where(some, counts.std(axis=1) / np.where(some, fair, 1.0), 0.0).tolist(),
        "dead": [int(n) for n in (counts < dead_below * fair[:, None]).sum(axis=1)],
        "overload": (counts.max(axis=1) / np.where(some, fair, 1.0)).tolist(),
    }
    if entropy_M is not None:
        health["entropy"] = _matching(entropy_M, (counts.shape[0],), "entropy_M").tolist()
    if bias_ME is not None:
        health["bias_norm"] = np.linalg.norm(_matching(bias_ME, counts.shape, "bias_ME"), axis=1).tolist()
    return health


def collapsed_layers(health: Mapping[str, Sequence[Any]], num_experts: int) -> list[int]:
    """Indices (0..M-1 among MoE layers) of the layers with `dead` ≥ num_experts / 2."""
    return [i for i, dead in enumerate(health["dead"]) if dead >= num_experts / 2]


def worst_layer(health: Mapping[str, Sequence[Any]]) -> int:
    """The index of the layer with the highest `load_cv` (the first of equals; a null cv never wins)."""
    cvs = [cv if cv is not None and math.isfinite(cv) else -math.inf for cv in health["load_cv"]]
    if not cvs:
        raise ValueError("no MoE layer in the expert health")
    return max(range(len(cvs)), key=cvs.__getitem__)


def summary(health: Mapping[str, Sequence[Any]], layer_names: Sequence[int | str]) -> str:
    """The progress line's text for the worst layer, e.g. "experts: cv 0.41 max×2.3 dead 3 @ layer 5".

    `layer_names[i]` names MoE layer i (typically `moe_layer_numbers(spec)`, the decoder layer number)."""
    i = worst_layer(health)
    return (f"experts: cv {health['load_cv'][i]:.2f} max×{health['overload'][i]:.1f} "
            f"dead {health['dead'][i]} @ layer {layer_names[i]}")


def moe_layer_numbers(spec: ModelSpec) -> list[int]:
    """The decoder layer number (0-based, the model's own numbering) of each MoE layer index 0..M-1:
    the layers not in `spec.dense_layers`, in order; [] for a dense model."""
    return list(spec.moe_layers)


def check_logged_health(value: Any, where: str, fix: str = "fix or delete that line") -> dict[str, list]:
    """`value` if it is an `expert_health` record as read back from an untrusted metrics log, else
    `UpcyclerError` naming `where`: a mapping whose known keys (`HEALTH_KEYS`) each hold a non-empty list
    of numbers (at most `MAX_MAGNITUDE` in size) or nulls, all of one length (the MoE layers). Unknown keys
    are kept as they are."""
    if not isinstance(value, dict):
        raise UpcyclerError(f"{where}: expert_health must be a mapping of per-layer lists, not "
                            f"{describe(value)}; {fix}")
    lengths = set()
    for key in HEALTH_KEYS:
        if key not in value:
            continue
        row = value[key]
        if not isinstance(row, list) or not row:
            raise UpcyclerError(f"{where}: expert_health.{key} must be a non-empty list, not "
                                f"{describe(row)}; {fix}")
        for number in row:
            if number is not None:
                real(number, f"expert_health.{key}", where, low=-MAX_MAGNITUDE, high=MAX_MAGNITUDE, fix=fix)
        lengths.add(len(row))
    if len(lengths) > 1:
        raise UpcyclerError(f"{where}: expert_health lists have different lengths {sorted(lengths)}; {fix}")
    return value


def _counts(counts_ME: Any) -> np.ndarray:
    counts = np.asarray(counts_ME, dtype=np.float64)
    if counts.ndim != 2 or 0 in counts.shape:
        raise ValueError(f"expert counts must be a non-empty [layers, experts] array, not shape {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError("expert counts must be finite and non-negative")
    return counts


def _matching(values: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (matching the counts), not {array.shape}")
    return array
