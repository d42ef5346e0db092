"""Compile the device prefill (`upcycle eval` on a TPU) for one chip ahead of time, from this host.

`compile_prefill(spec, cfg, chip=...)` lowers `device_prefill.prefill` (FlexPrefill through the splash
kernel, or dense) for `batch` prompts of `length` tokens on one chip of a TPU slice (libtpu describes it;
no chip is needed) and returns what it needs: the compiled peak per chip against the chip's HBM, and
the compiler's FLOP and byte counts. Weights are abstract (only the `ModelSpec`), in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from upcycler import hardware
from upcycler.spec import ModelSpec
from upcycler.train.aot.topology import parse_slice, tpu_devices
from upcycler.train.config import ModelConfig
from upcycler.train.evaluation.config import PrefillConfig


@dataclass(frozen=True)
class PrefillCompile:
    """One chip's compiled prefill: peak bytes (arguments + temporaries + outputs, as XLA reports them),
    the chip's HBM, whether it fits, the compiler's cost counts, and the executable."""

    peak_bytes: int
    hbm_bytes: int
    flops: float
    bytes_accessed: float
    executable: Any

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes


def compile_prefill(spec: ModelSpec, cfg: ModelConfig, *, chip: str = "v5e", batch: int = 1, length: int,
                    answer: int = 0, prefill: PrefillConfig = PrefillConfig()) -> PrefillCompile:
    """Compile the prefill of `batch` prompts of `length` tokens (then `answer` teacher-forced tokens) for
    one chip of generation `chip` (v5e, v6e, v5p, v4), FlexPrefill selecting as `prefill` says."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from upcycler.train.evaluation.device_prefill import prefill as device_prefill
    from upcycler.train.model.flexprefill_cost import ChipRates
    from upcycler.train.model.params import init_params

    slice_ = parse_slice(f"{chip}-{8 if chip in ('v4', 'v5p') else 4}")  # the smallest libtpu describes
    devices = tpu_devices(slice_)
    device = devices[0]
    mesh = Mesh([device], ("chip",))
    on_chip = NamedSharding(mesh, PartitionSpec())
    dtype = jnp.dtype(cfg.compute_dtype)
    params = jax.eval_shape(lambda: init_params(spec, jax.random.key(0), dtype))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip), params)
    ids = [jax.ShapeDtypeStruct((batch, n), jnp.int32, sharding=on_chip) for n in (length, answer)]
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        rates = ChipRates.of(hardware.for_devices(devices))
        compiled = device_prefill.lower(params, *ids, spec=spec, cfg=cfg, opts=prefill.options(),
                                        rates=rates).compile()
    memory = compiled.memory_analysis()
    peak = memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
    cost = compiled.cost_analysis() or {}
    return PrefillCompile(int(peak), hardware.for_devices(devices).hbm_budget_bytes, float(cost.get("flops", 0.0)),
                          float(cost.get("bytes accessed", 0.0)), compiled)
