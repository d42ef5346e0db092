"""The train step's memory options compute what the plain step computes.

Chunked cross-entropy, chunked attention, rematerialisation policies, weights cast before use and
microbatched gradient accumulation each change only what is alive at once. Every test runs the plain
path and the option on the same tiny model and batch (CPU, fp32 unless said) and compares the loss, the
metrics and the gradients (through one SGD step with learning rate 1, so new params = params − grads).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trainer_fixtures import VOCAB, tiny_spec
from xla_flags import FAST_COMPILE_OPTIONS

from upcycler.train.config import REMAT_POLICIES, LossConfig, ModelConfig
from upcycler.train.loop.train_step import TrainState, make_train_step
from upcycler.train.model import forward
from upcycler.train.model.params import init_params

B, L = 8, 16
FP32 = {"rtol": 2e-5, "atol": 2e-6}


def _batch(seed: int = 0, segments: bool = False) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    mask = np.ones((B, L), np.int32)
    mask[1, 10:] = 0  # padding: rows contribute different token counts
    mask[5, :3] = 0
    return {
        "inputs": jnp.asarray(rng.integers(0, VOCAB, (B, L)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, VOCAB, (B, L)), jnp.int32),
        "mask": jnp.asarray(mask),
        "source_id": jnp.asarray(rng.integers(0, 2, (B,)), jnp.int32),
    }


def _step(spec, cfg=ModelConfig(), loss=LossConfig(), microbatches=1, seed=0):
    """(metrics, new params) of one SGD step (lr 1) from fixed random parameters on a fixed batch; each
    distinct step is compiled and run once per test process (several tests compare against the same one)."""
    metrics, params = _cached_step(spec, cfg, loss, microbatches, seed)
    return dict(metrics), params


@functools.cache
def _cached_step(spec, cfg, loss, microbatches, seed):
    params = init_params(spec, jax.random.key(seed), std=0.05)
    tx = optax.sgd(1.0)
    step = make_train_step(spec, cfg, loss, tx, lambda s: jnp.float32(1.0), num_sources=2,
                           microbatches=microbatches)
    state = TrainState(jnp.asarray(0, jnp.int32), params, tx.init(params))
    new, metrics = jax.jit(step, compiler_options=FAST_COMPILE_OPTIONS)(state, _batch())
    return jax.device_get(metrics), jax.device_get(new.params)


def _temp_bytes(spec, remat: str) -> int:
    """The compiled train step's temporary bytes with `remat` (a larger batch, so activations dominate)."""
    params = init_params(spec, jax.random.key(0), std=0.05)
    tx = optax.sgd(1.0)
    step = make_train_step(spec, ModelConfig(remat=remat), LossConfig(), tx, lambda s: jnp.float32(1.0),
                           num_sources=2)
    state = TrainState(jnp.asarray(0, jnp.int32), params, tx.init(params))
    batch = {k: jnp.tile(v, (4, 4)) if v.ndim == 2 else jnp.tile(v, 4) for k, v in _batch().items()}
    compiled = jax.jit(step, compiler_options=FAST_COMPILE_OPTIONS).lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _assert_same(a, b, **tol):
    (m_a, p_a), (m_b, p_b) = a, b
    assert set(m_a) == set(m_b)
    for key in m_a:
        np.testing.assert_allclose(np.asarray(m_a[key], np.float64), np.asarray(m_b[key], np.float64),
                                   err_msg=key, **tol)
    leaves_a, leaves_b = jax.tree.leaves(p_a), jax.tree.leaves(p_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(x, y, **tol)


def _changed(params_before_seed, after):
    """The step really moved the parameters (a test comparing two no-ops would pass trivially)."""
    before = init_params(*params_before_seed)
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_chunked_cross_entropy_equals_whole_logits(moe):
    spec = tiny_spec(moe=moe)
    plain = _step(spec)
    assert _changed((spec, jax.random.key(0), jnp.float32, 0.05), plain[1]) > 1e-4
    _assert_same(plain, _step(spec, loss=LossConfig(ce_chunk=4)), **FP32)


def test_chunked_attention_equals_einsum_causal_and_windowed():
    spec = tiny_spec(moe=True)
    _assert_same(_step(spec), _step(spec, ModelConfig(attention="chunked", attention_chunk=4)), **FP32)
    windowed = tiny_spec(sliding_window=5)
    _assert_same(_step(windowed), _step(windowed, ModelConfig(attention="chunked", attention_chunk=8)), **FP32)


def test_chunked_attention_with_packed_segments_equals_einsum():
    spec = tiny_spec()
    params = init_params(spec, jax.random.key(3), std=0.05)
    ids = _batch()["inputs"]
    segments = jnp.asarray(np.repeat(np.arange(4), 4)[None].repeat(B, 0))

    cotangent = jax.random.normal(jax.random.key(4), (*ids.shape, spec.vocab_size))

    def loss(p, cfg):  # a random cotangent: every logit's gradient path, none amplified (sin(~200) was)
        logits, _ = forward(p, ids, spec, cfg, segment_ids_BL=segments)
        return jnp.sum(logits * cotangent)

    base_value, base_grad = jax.value_and_grad(loss)(params, ModelConfig())
    value, grad = jax.value_and_grad(loss)(params, ModelConfig(attention="chunked", attention_chunk=4))
    np.testing.assert_allclose(value, base_value, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(grad), jax.tree.leaves(base_grad), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_policies_equal_no_remat(policy, moe):
    """Every policy (named activations kept on the device or offloaded to host memory, the rest
    recomputed) gives the plain step's loss, metrics and updated parameters."""
    spec = tiny_spec(moe=moe)
    plain, remat = _step(spec), _step(spec, ModelConfig(remat=policy))
    assert _changed((spec, jax.random.key(0), jnp.float32, 0.05), remat[1]) > 1e-4
    _assert_same(plain, remat, **FP32)


@pytest.mark.parametrize("policy", ["attention", "offload_attention_and_ffn_input"])
def test_remat_policies_keep_what_they_name(policy):
    """A policy changes what the compiled step keeps: the activations between the passes (the compiled
    step's temporary memory) fall from no remat to the policy to full remat, so the names are attached
    to the activations they claim (a name on nothing would keep the step's memory at full remat's)."""
    spec = tiny_spec(moe=True)
    temps = {name: _temp_bytes(spec, name) for name in ("none", policy, "full")}
    assert temps["none"] > temps[policy] > temps["full"], temps


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("k", [2, 4])
def test_microbatches_equal_one_batch(moe, k):
    """Cross-entropy, z-loss and their gradients add up exactly over microbatches; the load-balancing
    loss is a per-microbatch statistic, so it is switched off here and compared on its own below."""
    spec = tiny_spec(moe=moe)
    loss = LossConfig(lb_coef=0.0, z_coef=0.01)
    plain = _step(spec, loss=loss)
    micro = _step(spec, loss=loss, microbatches=k)
    plain[0].pop("lb_loss", None)
    micro[0].pop("lb_loss", None)
    _assert_same(plain, micro, **FP32)


def test_microbatch_load_balancing_is_the_token_weighted_mean_of_the_parts():
    spec = tiny_spec(moe=True)
    batch = _batch()
    whole = _step(spec, microbatches=2)[0]
    parts = []
    for j in range(2):  # microbatch j holds rows j, j + 2, ...
        rows = {k: v[j::2] for k, v in batch.items()}
        parts.append(_metrics_of(spec, rows))
    tokens = np.array([p["tokens"] for p in parts])
    expected = float(np.sum(tokens * np.array([p["lb_loss"] for p in parts])) / tokens.sum())
    np.testing.assert_allclose(whole["lb_loss"], expected, rtol=1e-5)
    assert whole["tokens"] == tokens.sum()


def _metrics_of(spec, batch):
    params = init_params(spec, jax.random.key(0), std=0.05)
    tx = optax.sgd(1.0)
    step = make_train_step(spec, ModelConfig(), LossConfig(), tx, lambda s: jnp.float32(1.0), num_sources=2)
    state = TrainState(jnp.asarray(0, jnp.int32), params, tx.init(params))
    return jax.device_get(jax.jit(step, compiler_options=FAST_COMPILE_OPTIONS)(state, batch)[1])


def test_weights_cast_before_use_equal_casting_where_used():
    """bf16 weights cast once per step give the bf16 forward's loss; gradients agree to bf16 precision
    (the tied embedding's two uses are summed in bf16 instead of fp32)."""
    spec = tiny_spec(moe=True)
    bf16 = ModelConfig(compute_dtype="bfloat16")
    plain = _step(spec, bf16)
    cast = _step(spec, replace(bf16, weights_dtype="bfloat16"))
    np.testing.assert_allclose(cast[0]["loss"], plain[0]["loss"], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(cast[1]), jax.tree.leaves(plain[1]), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-3)


def test_weights_cast_keeps_router_and_buffers_in_float32():
    from upcycler.train.model import weights_for_compute

    base = tiny_spec(moe=True)
    spec = replace(base, family="glm4_moe", moe=replace(base.moe, router="sigmoid", router_bias=True))
    params = init_params(spec, jax.random.key(0))
    cast = weights_for_compute(params, spec, ModelConfig(weights_dtype="bfloat16"))
    moe_layer = cast["layers"]["moe"]["moe"]
    assert moe_layer["router"].dtype == jnp.float32
    assert moe_layer["experts"]["gate_proj"].dtype == jnp.bfloat16
    assert cast["embed"].dtype == jnp.bfloat16
    buffers = [k for k in moe_layer if k.endswith("bias") and moe_layer[k].dtype == jnp.float32]
    assert buffers, "the sigmoid router's selection bias is a buffer and stays float32"
    from upcycler.layout import declare_params

    declared = [d.name for d in declare_params(spec) if d.computed_in_fp32]  # said where it is declared
    assert declared == [f"layers.{i}.moe.router" for i in range(spec.num_layers) if spec.is_moe_layer(i)]
