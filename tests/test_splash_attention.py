"""`attention: splash` (JAX's Pallas TPU flash-attention kernel, run by the interpreter here) computes what
the einsum attention computes: forward and gradients, grouped-query and multi-head, packed documents
(segment ids, as `hidden_states` takes them), sliding windows, layers of two windows in one scan; and the
train step of a model equals the einsum one.
The kernel tiles the sequence by 128, so these use 256 tokens (two tiles: the causal skip is exercised).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trainer_fixtures import VOCAB, tiny_spec

from upcycler.errors import UpcyclerError
from upcycler.train.config import LossConfig, ModelConfig, TrainConfig
from upcycler.train.loop.train_step import TrainState, make_train_step
from upcycler.train.model import layers as nn
from upcycler.train.model import splash
from upcycler.train.model.params import init_params
from upcycler.train.model.placement import ONE_DEVICE

B, L, HEAD = 2, 256, 16
FP32 = {"rtol": 2e-5, "atol": 2e-5}


def _segments() -> jax.Array:
    """Row 0: one document; row 1: three packed documents of 100, 90 and 66 tokens."""
    return jnp.asarray([[0] * L, [0] * 100 + [1] * 90 + [2] * 66], jnp.int32)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [0, 130], ids=["full", "window130"])
def test_splash_equals_einsum_attention_and_its_gradients(heads, kv_heads, window):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, L, n, HEAD)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    segments = _segments()
    visible, distance = nn.attention_mask(segments, B, L)
    visible = nn.window_mask(visible, distance, jnp.int32(window))

    def einsum(q, k, v):
        return nn.attention(q, k, v, visible)

    def kernel(q, k, v):  # the layer's window chosen at run time among the scan's two
        return splash.attention(q, k, v, segment_ids_BL=segments, window=jnp.int32(window), windows=(0, 130),
                                placement=ONE_DEVICE)

    np.testing.assert_allclose(kernel(q, k, v), einsum(q, k, v), **FP32)
    cotangent = jnp.asarray(rng.standard_normal((B, L, heads, HEAD)), jnp.float32)
    for got, want in zip(jax.grad(lambda *a: jnp.vdot(kernel(*a), cotangent), argnums=(0, 1, 2))(q, k, v),
                         jax.grad(lambda *a: jnp.vdot(einsum(*a), cotangent), argnums=(0, 1, 2))(q, k, v),
                         strict=True):
        np.testing.assert_allclose(got, want, **FP32)


def _step(spec, attention: str):
    params = init_params(spec, jax.random.key(0), std=0.05)
    tx = optax.sgd(1.0)
    step = make_train_step(spec, ModelConfig(attention=attention), LossConfig(), tx, lambda s: jnp.float32(1.0),
                           num_sources=2)
    rng = np.random.default_rng(1)
    batch = {"inputs": jnp.asarray(rng.integers(0, VOCAB, (B, L)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, VOCAB, (B, L)), jnp.int32),
             "mask": jnp.ones((B, L), jnp.int32), "source_id": jnp.asarray([0, 1], jnp.int32)}
    new, metrics = jax.jit(step)(TrainState(jnp.asarray(0, jnp.int32), params, tx.init(params)), batch)
    return jax.device_get(metrics), jax.device_get(new.params)


@pytest.mark.parametrize("model", ["moe", "windowed"])
def test_the_train_step_with_splash_equals_the_einsum_step(model):
    """The MoE and a dense model whose layers alternate full and sliding-window attention in one scan: loss,
    metrics and the parameters after one SGD step (lr 1)."""
    if model == "moe":
        spec = tiny_spec(moe=True, max_position_embeddings=L)
    else:
        spec = tiny_spec(num_layers=4, sliding_window=130, max_position_embeddings=L,
                         layer_types=("full_attention", "sliding_attention") * 2)
    (m_a, p_a), (m_b, p_b) = _step(spec, "splash"), _step(spec, "einsum")
    assert set(m_a) == set(m_b)
    for key in m_a:
        np.testing.assert_allclose(np.asarray(m_a[key], np.float64), np.asarray(m_b[key], np.float64), err_msg=key,
                                   rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(p_a), jax.tree.leaves(p_b), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_splash_needs_whole_tiles_of_128_tokens(tmp_path):
    from trainer_fixtures import config_dict

    raw = config_dict(tmp_path, tmp_path / "model", tmp_path / "data", **{"model.attention": "splash"})
    raw["data"]["seq_len"] = 200
    with pytest.raises(UpcyclerError, match=r"multiple of 128"):
        TrainConfig.from_dict(raw, "train.yaml")
    raw["data"]["seq_len"] = 256
    assert TrainConfig.from_dict(raw, "train.yaml").model.attention == "splash"
    assert replace(ModelConfig(), attention="splash").attention == "splash"
    assert [splash.block_size(n) for n in (4096, 384, 128, 200)] == [512, 128, 128, None]
