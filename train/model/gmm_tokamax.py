"""The `"tokamax"` grouped-matmul backend: tokamax's `ragged_dot` under `gmm.gmm`'s contract.

tokamax (JAX >= 0.11.1, Python >= 3.12; the `[tpu]` extra installs it there) ships grouped-matmul kernels
for TPU: `gmm_v2` for the forward product and dx (the weight read transposed in the kernel, not in HBM)
and `tgmm_v2` for dW, each with its own VJP and its own tiles from the chip's VMEM. Each group's row tiles
start at the group's first row, rounded up to a row bucket, where megablox revisits a whole row tile once
per expert it holds. On the reference MoE layer compiled for one v5e chip (`bench/tokamax_gmm.py`, every
kernel charged by one tile model) forward and backward take a 26.1 ms bound against megablox's 29.9 ms,
at the same peak memory, so `gmm`'s `"auto"` takes it on TPU wherever it is installed.

On TPU the call is `implementation="mosaic_tpu_v2"`. Elsewhere (CPU, GPU) tokamax has no kernel of this
kind and the call is its `"xla"` implementation (`lax.ragged_dot_general`): the same contract, so a CPU test
checks this adapter (masking, the VJP, dtypes), not the TPU kernel, which only a TPU runs (tokamax's v2
kernels do not run in Pallas' interpreter).

The contract kept here (`gmm.gmm`): rows past sum(group_sizes) come out zero, and their cotangent is zero.
The kernels leave those rows undefined (NaN in practice), so they are selected away, not multiplied by
zero. A program compiled for TPU from another host (`--compile-only`) runs tokamax's device checks against
the host: its `cross_compile` option is set while the forward and the backward are traced.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging

import jax

from upcycler.train.model.gmm_rows import zero_cotangent_past, zero_rows_past

TPU_IMPLEMENTATION = "mosaic_tpu_v2"
OTHER_IMPLEMENTATION = "xla"
MIN_JAX = (0, 11, 1)


def tokamax_available() -> bool:
    """Whether tokamax is installed with a JAX it runs on (imports nothing)."""
    if importlib.util.find_spec("tokamax") is None:
        return False
    version = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
    return version >= MIN_JAX


def tokamax_gmm(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *, platform: str,
                all_rows_grouped: bool = False) -> jax.Array:
    """`gmm.gmm`'s contract on tokamax: rows of group g times `w[g]` ([G, in, out]), rows past the groups 0,
    in `x_sorted.dtype` (the kernel accumulates in fp32). Differentiable in `x_sorted` and `w` through
    tokamax's own VJP. `platform` is the one compiled for (`gmm.target_platform()`)."""
    if not tokamax_available():
        raise ValueError("the tokamax gmm backend needs tokamax with JAX >= 0.11.1 (Python >= 3.12): "
                         "pip install 'upcycler[tpu]', or use gmm_backend auto")
    implementation = TPU_IMPLEMENTATION if platform == "tpu" else OTHER_IMPLEMENTATION
    cross = platform != jax.default_backend()
    if all_rows_grouped:
        return _ragged(x_sorted, w, group_sizes, implementation, cross)
    total = group_sizes.sum()
    out = _ragged(zero_cotangent_past(x_sorted, total), w, group_sizes, implementation, cross)
    return zero_rows_past(out, total)


def _ragged(x, w, group_sizes, implementation: str, cross: bool) -> jax.Array:
    """tokamax's ragged dot; compiled for another platform than the host's, its backward is traced under the
    same `cross_compile` setting as its forward (`_cross_compiled`)."""
    return (_cross_compiled if cross else _call)(x, w, group_sizes, implementation)


def _call(x, w, group_sizes, implementation: str) -> jax.Array:
    import tokamax

    _quiet_cache_misses()
    return tokamax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype, implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_compiled(x, w, group_sizes, implementation: str) -> jax.Array:
    with _host_checks_off():
        return _call(x, w, group_sizes, implementation)


def _cross_compiled_fwd(x, w, group_sizes, implementation: str):
    with _host_checks_off():
        return jax.vjp(lambda a, b: _call(a, b, group_sizes, implementation), x, w)  # (out, tokamax's VJP)


def _cross_compiled_bwd(implementation: str, pull, g):
    with _host_checks_off():
        return (*pull(g), None)


_cross_compiled.defvjp(_cross_compiled_fwd, _cross_compiled_bwd)


@functools.cache
def _quiet_cache_misses() -> None:
    """tokamax logs a warning for every kernel shape its autotuning cache lacks, then takes its own VMEM
    heuristic, which is what this backend uses: those lines say nothing to a user, so they are dropped."""
    logging.getLogger("absl").addFilter(lambda record: not str(record.msg).startswith("Autotuning cache miss"))


def _host_checks_off() -> contextlib.AbstractContextManager:
    """tokamax's device checks off: its kernels are compiled here for a chip elsewhere."""
    import tokamax

    return tokamax.config.cross_compile(True)
