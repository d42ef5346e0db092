"""The `"tokamax"` grouped-matmul backend (`train/model/gmm_tokamax.py`).

Where tokamax is installed (Python >= 3.12, JAX >= 0.11.1; CI's newest-JAX line): on the CPU the backend
runs tokamax's XLA implementation and must equal the tiled backend, output and both gradients, with the
rows past the groups zero and their gradient zero; compiled for one v5e chip, `"auto"` takes tokamax's
TPU kernels (gmm_v2 forward and dx, tgmm_v2 dW) and the compile report charges their row buckets. Those
kernels only run on a TPU (they do not run in Pallas' interpreter), so their numbers are not checked here.
Where it is not installed (Python 3.11, JAX 0.10), `"auto"` keeps megablox and asking for tokamax is
refused in one line, before a run starts.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_checks import assert_transposed_weight_gives_the_same, gmm_with_grads
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from upcycler.errors import UpcyclerError
from upcycler.train.model import moe
from upcycler.train.model.gmm import gmm, resolve_backend

INSTALLED = importlib.util.find_spec("tokamax") is not None
needs_tokamax = pytest.mark.skipif(not INSTALLED, reason="tokamax needs Python >= 3.12 and JAX >= 0.11.1")
GROUP_SIZES = {"uneven, an empty group, rows past the groups": [10, 0, 30, 17, 20],
               "every row grouped": [40, 16, 0, 8, 32]}  # 96 rows


@needs_tokamax
@pytest.mark.parametrize("case", GROUP_SIZES)
def test_tokamax_equals_tiled_with_zero_rows_past_the_groups(case):
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.normal(size=(96, 32)), jnp.float32), jnp.asarray(rng.normal(size=(5, 32, 48)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(96, 48)), jnp.float32)
    sizes = jnp.asarray(GROUP_SIZES[case], jnp.int32)
    out, (dx, dw) = gmm_with_grads("tokamax")(x, w, sizes, cotangent)
    want, (want_dx, want_dw) = gmm_with_grads("tiled")(x, w, sizes, cotangent)
    for got, expected in ((out, want), (dx, want_dx), (dw, want_dw)):
        assert float(jnp.abs(got - expected).max()) <= 1e-5 * float(jnp.abs(expected).max())
    grouped = int(sizes.sum())
    assert not jnp.any(out[grouped:]) and not jnp.any(dx[grouped:])
    empty = GROUP_SIZES[case].index(0)
    assert not jnp.any(dw[empty])  # the empty group's weights get nothing
    bf16 = gmm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, backend="tokamax")
    assert bf16.dtype == jnp.bfloat16


@needs_tokamax
def test_tokamax_reads_a_transposed_weight_as_the_stored_one():
    """`transpose_rhs` (the MoE's down weight as stored, [G, out, in]), which `gmm` swaps before tokamax's
    kernels: the same output and dx, dW in the stored layout."""
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.normal(size=(96, 32)), jnp.float32), jnp.asarray(rng.normal(size=(5, 32, 48)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(96, 48)), jnp.float32)
    sizes = jnp.asarray(GROUP_SIZES["uneven, an empty group, rows past the groups"], jnp.int32)
    assert_transposed_weight_gives_the_same("tokamax", x, w, sizes, cotangent, rtol=1e-5, atol=1e-5)


@functools.cache
def _v5e_chip() -> Mesh:
    from upcycler.train.aot.topology import parse_slice, tpu_devices

    return tpu_devices(parse_slice("v5e-4"))


@needs_tokamax
def test_auto_compiles_tokamax_kernels_for_one_v5e_chip_and_the_report_charges_their_buckets():
    from upcycler.train.aot import hbm_traffic
    from upcycler.train.aot.compile import without_persistent_cache

    one, four = (Mesh(np.array(_v5e_chip()[:n]), ("data",)) for n in (1, 4))
    T, D, F, E, K = 256, 256, 256, 8, 2

    def loss(params, cotangent):
        x, w_gate_up, w_down, w_router = params
        routing = moe.route(moe.router_logits(x, w_router), K, "renormalized")
        return jnp.sum(moe.dropless_moe(x, w_gate_up, w_down, routing, backend="auto").astype(jnp.float32)
                       * cotangent)

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(one, P()))

    bf16 = jnp.bfloat16
    args = ((arg((T, D), bf16), arg((E, D, 2 * F), bf16), arg((E, D, F), bf16), arg((E, D), jnp.float32)),
            arg((T, D), jnp.float32))
    with jax.set_mesh(one), without_persistent_cache():  # a v5e executable cannot be loaded back here
        assert resolve_backend("auto") == "tokamax"
        hlo = jax.jit(jax.value_and_grad(loss)).lower(*args).compile().as_text()
    computations, _ = hbm_traffic.parse_module(hlo)
    kernels = [(i, c) for c in computations.values() for i in c.instrs.values() if "gmm_v2-g_8-m_512" in i.name]
    names = sorted(i.name.split("-")[0] for i, _ in kernels)
    assert names == ["gmm_v2"] * 4 + ["tgmm_v2"] * 2, names  # gate/up and down: forward, dx, dW
    # 512 rows in 8 groups, each rounded up to its bucket (128 or 256 rows): half a bucket per group
    assert {hbm_traffic.grid_repeats(i, c) for i, c in kernels} <= {2.0, 3.0}
    assert hbm_traffic.grouped_matmul_waste(hlo) > 0
    with jax.set_mesh(four):  # XLA cannot partition a Pallas kernel: the partitioned layer gets ragged_dot
        assert resolve_backend("auto") == "ragged_dot"
        with pytest.raises(ValueError, match="shard_map"):
            x, w = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((128, 128), (2, 128, 128)))
            jax.jit(functools.partial(gmm, backend="tokamax")).lower(x, w, jax.ShapeDtypeStruct((2,), jnp.int32))


@pytest.mark.skipif(INSTALLED, reason="tokamax is installed here")
def test_without_tokamax_auto_keeps_megablox_and_a_run_asking_for_it_is_refused(tmp_path):
    from trainer_fixtures import config_dict, tiny_spec

    from upcycler.train.config import TrainConfig
    from upcycler.train.loop.preflight import check_spec_options

    assert resolve_backend("auto", "tpu") == "megablox"
    with pytest.raises(ValueError, match="JAX >= 0.11.1"):
        gmm(jnp.zeros((4, 8)), jnp.zeros((2, 8, 8)), jnp.array([2, 2]), backend="tokamax")
    raw = config_dict(tmp_path, tmp_path / "moe", tmp_path / "data", **{"model.gmm_backend": "tokamax"})
    config = TrainConfig.from_dict(raw)
    with pytest.raises(UpcyclerError, match=r"model.gmm_backend tokamax needs tokamax.*set model.gmm_backend auto"):
        check_spec_options(config, tiny_spec(moe=True))
