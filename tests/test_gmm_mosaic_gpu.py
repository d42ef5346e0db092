"""The mosaic_gpu grouped-matmul backend (JAX's Pallas Mosaic GPU kernels for Hopper).

Its refusals are checked everywhere. Its results, against the tiled backend, need an NVIDIA Hopper GPU
(the kernels are wgmma programs; there is no interpreter for them): on any other host those cases are
skipped, saying so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_checks import gmm_with_grads

from upcycler.train.model.gmm import gmm, resolve_backend
from upcycler.train.model.gmm_mosaic_gpu import mosaic_gpu_gmm


def _hopper() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


# name: (rows M, in, out, group sizes); all bfloat16
CASES = {
    "aligned_with_empty_groups": (256, 128, 256, [60, 0, 100, 0, 40]),
    "unaligned_dims_and_rows": (200, 100, 72, [30, 0, 0, 101, 45]),
    "full_rows_group_crossing_tiles": (256, 128, 128, [0, 130, 126]),
    "many_groups": (4096, 512, 384, list(np.random.default_rng(1).multinomial(4000, np.ones(64) / 64))),
}


@pytest.mark.skipif(not _hopper(), reason="needs an NVIDIA Hopper GPU: the Mosaic GPU kernels are wgmma programs")
@pytest.mark.parametrize("name", CASES)
def test_mosaic_gpu_matches_tiled_in_output_and_gradients(name: str) -> None:
    m, k, n, sizes = CASES[name]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    cotangent = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    args = (x, w, jnp.asarray(sizes, jnp.int32), cotangent)
    out, (dx, dw) = gmm_with_grads("mosaic_gpu")(*args)
    want_out, (want_dx, want_dw) = gmm_with_grads("tiled")(*args)
    assert out.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert out.shape == (m, n) and dx.shape == (m, k) and dw.shape == (len(sizes), k, n)
    for got, want, what in ((out, want_out, "out"), (dx, want_dx, "dx"), (dw, want_dw, "dw")):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got)), what
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(want).max()), err_msg=what)
    total = int(sum(sizes))
    np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(dx[total:], np.float32), 0.0)


def test_mosaic_gpu_refusals_name_the_fix() -> None:
    x, w, sizes = jnp.zeros((8, 128), jnp.float32), jnp.zeros((2, 128, 128), jnp.float32), jnp.array([4, 4])
    with pytest.raises(ValueError, match="compute_dtype bfloat16"):
        mosaic_gpu_gmm(x, w, sizes)
    with pytest.raises(ValueError, match="one dtype"):
        mosaic_gpu_gmm(x.astype(jnp.bfloat16), w.astype(jnp.float16), sizes)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=f"cannot run on {jax.default_backend()}"):
            gmm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, backend="mosaic_gpu")


def test_auto_takes_mosaic_gpu_for_16_bit_operands_on_hopper_only() -> None:
    on_hopper = "mosaic_gpu" if _hopper() else "tiled"
    assert resolve_backend("auto", "gpu", jnp.bfloat16) == on_hopper
    assert resolve_backend("auto", "gpu", jnp.float16) == on_hopper
    assert resolve_backend("auto", "gpu", jnp.float32) == "tiled"  # wgmma takes 16-bit operands
    assert resolve_backend("auto", "gpu") == "tiled"  # operand dtype unknown, or x and w differ
    assert resolve_backend("auto", "cpu", jnp.bfloat16) == "tiled"
    assert resolve_backend("tiled", "gpu", jnp.bfloat16) == "tiled"
