"""Shared by the grouped-matmul backend tests: one compiled output-and-gradients function per backend."""

from __future__ import annotations

import functools
import importlib.util

import jax

from upcycler.train.model.gmm import gmm

# what "auto" takes on TPU: tokamax's kernels where tokamax is installed (it installs only with JAX >= 0.11.1)
TPU_AUTO = "tokamax" if importlib.util.find_spec("tokamax") else "megablox"


@functools.cache
def gmm_with_grads(backend: str):
    """gmm's output and (dx, dw) of sum(out * cotangent), jitted: call with (x, w, group_sizes, cotangent)."""

    def run(x, w, group_sizes, cotangent):
        out, vjp = jax.vjp(lambda x, w: gmm(x, w, group_sizes, backend=backend), x, w)
        return out, vjp(cotangent)

    return jax.jit(run)
