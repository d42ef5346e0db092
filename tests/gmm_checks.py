"""Shared by the grouped-matmul backend tests: one compiled output-and-gradients function per backend."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.train.model.gmm import gmm

# what "auto" takes on TPU: tokamax's kernels where tokamax is installed (it installs only with JAX >= 0.11.1)
TPU_AUTO = "tokamax" if importlib.util.find_spec("tokamax") else "megablox"


@functools.cache
def gmm_with_grads(backend: str, transpose_rhs: bool = False):
    """gmm's output and (dx, dw) of sum(out * cotangent), jitted: call with (x, w, group_sizes, cotangent)."""

    def run(x, w, group_sizes, cotangent):
        out, vjp = jax.vjp(lambda x, w: gmm(x, w, group_sizes, backend=backend, transpose_rhs=transpose_rhs), x, w)
        return out, vjp(cotangent)

    return jax.jit(run)


def assert_transposed_weight_gives_the_same(backend: str, x, w, group_sizes, cotangent, **tol) -> None:
    """gmm of `w` ([G, in, out]) and of its transpose read with `transpose_rhs` ([G, out, in]): the same
    output and dx, and dW in the layout of the weight given."""
    out, (dx, dw) = gmm_with_grads(backend)(x, w, group_sizes, cotangent)
    out_t, (dx_t, dw_t) = gmm_with_grads(backend, True)(x, jnp.swapaxes(w, 1, 2), group_sizes, cotangent)
    assert dw_t.shape == (w.shape[0], w.shape[2], w.shape[1]) and dw_t.dtype == w.dtype
    for got, want, what in ((out_t, out, "out"), (dx_t, dx, "dx"), (jnp.swapaxes(dw_t, 1, 2), dw, "dw")):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=what, **tol)
