"""FlexPrefill on a GPU (`flexprefill_gpu`): the Triton kernel, run by the Pallas interpreter here,
computes what the CPU path computes on the same block masks (grouped-query and multi-head, lengths on
and off the block grid, prompts of one batch with different masks); full masks equal dense causal
attention; a band of blocks with a window equals the windowed dense path; tiles Triton cannot take are
refused; and the kernel lowers to Triton IR for CUDA on this CPU-only machine (no GPU plugin needed:
jaxlib ≤ 0.10.2 hands XLA the Triton module uncompiled), so a kernel Triton's lowering would reject
fails here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycler.train.model import flexprefill as fp
from upcycler.train.model import flexprefill_gpu as fg

BLOCK = 16
FP32 = {"rtol": 2e-5, "atol": 2e-5}


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def qkv(seed: int, batch: int, n: int, heads: int, kv_heads: int, head_dim: int = 32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((batch, n, m, head_dim)), jnp.float32)
                 for m in (heads, kv_heads, kv_heads))


def causal(batch: int, heads: int, nb: int) -> np.ndarray:
    return np.broadcast_to(np.tril(np.ones((nb, nb), bool)), (batch, heads, nb, nb))


def random_masks(seed: int, batch: int, heads: int, nb: int) -> np.ndarray:
    """[B, H, nb, nb] random causal block masks that keep the diagonal (rows of different counts)."""
    keep = np.random.default_rng(seed).random((batch, heads, nb, nb)) < 0.4
    return (keep | np.eye(nb, dtype=bool)) & causal(batch, heads, nb)


def host_sparse(q, k, v, mask_BHnn, block: int = BLOCK) -> np.ndarray:
    """The CPU path's attention over the same blocks, prompt by prompt."""
    nb = mask_BHnn.shape[-1]
    return np.stack([fp.sparse_attention(q[b], k[b], v[b], *fp.block_lists(jnp.asarray(mask_BHnn[b]), nb), block)
                     for b in range(q.shape[0])])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("n", [96, 90], ids=["aligned", "unaligned"])
def test_kernel_equals_the_sparse_path_on_the_same_masks(heads, kv_heads, n):
    q, k, v = qkv(0, 2, n, heads, kv_heads)
    mask = random_masks(1, 2, heads, math.ceil(n / BLOCK))
    assert (mask.sum(-1) < np.arange(1, mask.shape[-1] + 1)).any()  # some rows skip blocks
    got = fg.block_sparse_attention(q, k, v, jnp.asarray(mask), BLOCK, interpret=True)
    np.testing.assert_allclose(got, host_sparse(q, k, v, mask), **FP32)


def test_blocks_above_the_diagonal_are_ignored():
    """Marks above the diagonal (outside the contract) are dropped, as the sparse path never shows them."""
    q, k, v = qkv(6, 1, 90, 2, 2)
    mask = random_masks(7, 1, 2, 6)
    got = fg.block_sparse_attention(q, k, v, jnp.asarray(mask | ~causal(1, 2, 6)), BLOCK, interpret=True)
    np.testing.assert_allclose(got, host_sparse(q, k, v, mask), **FP32)


def test_prompts_of_one_batch_follow_their_own_masks():
    """A prompt that fell back (the full causal mask) beside a sparse one (sink and diagonal only): each is
    its own path's attention, the first the dense one."""
    n, nb = 90, 6
    q, k, v = qkv(2, 2, n, 4, 2)
    sparse = np.eye(nb, dtype=bool)
    sparse[:, 0] = True
    mask = np.stack([causal(1, 4, nb)[0], np.broadcast_to(sparse, (4, nb, nb))])
    got = np.asarray(fg.block_sparse_attention(q, k, v, jnp.asarray(mask), BLOCK, interpret=True))
    np.testing.assert_allclose(got[0], fp.causal_attention(q[0], k[0], v[0]), **FP32)
    np.testing.assert_allclose(got[1], host_sparse(q[1:], k[1:], v[1:], mask[1:])[0], **FP32)


@pytest.mark.parametrize("n", [128, 100], ids=["aligned", "unaligned"])
def test_full_masks_equal_causal_attention(n):
    q, k, v = qkv(3, 1, n, 4, 2)
    full = causal(1, 4, math.ceil(n / 32))
    got = fg.block_sparse_attention(q, k, v, jnp.asarray(full), 32, interpret=True)
    np.testing.assert_allclose(got[0], fp.causal_attention(q[0], k[0], v[0]), **FP32)


@pytest.mark.parametrize("blocks", ["band", "full"])
def test_a_window_equals_the_windowed_dense_path(blocks):
    """The band of block diagonals a window of 40 keys reaches (distance < 40: 3 diagonals of 16), or every
    causal block: with the window, both are the sliding-window attention."""
    n, window = 90, 40
    nb = math.ceil(n / BLOCK)
    q, k, v = qkv(4, 1, n, 4, 2)
    reach = math.ceil((window - 1) / BLOCK)
    band = np.tril(np.ones((nb, nb), bool)) & np.triu(np.ones((nb, nb), bool), -reach)
    mask = np.broadcast_to(band, (1, 4, nb, nb)) if blocks == "band" else causal(1, 4, nb)
    got = fg.block_sparse_attention(q, k, v, jnp.asarray(mask), BLOCK, window=window, interpret=True)
    np.testing.assert_allclose(got[0], fp.causal_attention(q[0], k[0], v[0], window=window), **FP32)


@pytest.mark.parametrize("block,head_dim", [(24, 32), (8, 32), (16, 24)])
def test_tiles_triton_cannot_take_are_refused(block, head_dim):
    q, k, v = qkv(5, 1, 48, 2, 2, head_dim)
    mask = causal(1, 2, math.ceil(48 / block))
    with pytest.raises(ValueError, match="power of two"):
        fg.block_sparse_attention(q, k, v, jnp.asarray(mask), block, interpret=True)


def lower_for_cuda(n: int, block: int, dtype, window: int = 0):
    """The kernel lowered for CUDA without a GPU: the StableHLO text, holding the Triton module."""
    nb = math.ceil(n / block)
    shape = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
    fn = jax.jit(lambda q, k, v, m: fg.block_sparse_attention(q, k, v, m, block, window=window))
    traced = fn.trace(shape(2, n, 4, 64), shape(2, n, 2, 64), shape(2, n, 2, 64), shape(2, 4, nb, nb, d=bool))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype,window", [(jnp.bfloat16, 0), (jnp.float32, 100)], ids=["bf16", "fp32_window"])
def test_the_kernel_lowers_to_triton(dtype, window):
    text = lower_for_cuda(1000, 64, dtype, window)
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text  # the IR, or (jaxlib > 0.10.2) compiled


def test_the_lowering_check_catches_tiles_triton_rejects(monkeypatch):
    """The lowering is a real check: with the kernel's own refusal off, a 24-token block fails in it."""
    monkeypatch.setattr(fg, "check_tile", lambda *_: None)
    with pytest.raises(ValueError, match="power of 2"):
        lower_for_cuda(96, 24, jnp.float32)


def test_device_prefill_on_the_gpu_kernels_equals_the_host_prefill():
    """A 3-layer model (a sliding-window layer, two full ones) prefilled as on a GPU, the Triton kernel and
    the platform's fused dense attention interpreted here, equals the layer-by-layer host prefill: logits,
    densities, and the sparse kernel reported for the full layers only."""
    from trainer_fixtures import tiny_spec

    from upcycler.train.config import ModelConfig
    from upcycler.train.evaluation.config import PrefillConfig
    from upcycler.train.evaluation.prefill import PrefillModel
    from upcycler.train.model.params import init_params

    spec = tiny_spec(num_layers=3, layer_types=("sliding_attention", "full_attention", "full_attention"),
                     sliding_window=50, max_position_embeddings=1024, head_dim=16)
    params = init_params(spec, jax.random.key(0))
    cfg = ModelConfig(compute_dtype="float32", attention="flexprefill")
    prefill = PrefillConfig(prefill_block=32, prefill_min_budget=32, prefill_gamma=0.3, prefill_tau=0.0,
                            prefill_dense_above=1.0, prefill_kernel="sparse")
    host = PrefillModel(spec, params, cfg, prefill=prefill, device=False)
    device = PrefillModel(spec, params, cfg, prefill=prefill, device=True, interpret=True, platform="gpu")
    rng = np.random.default_rng(5)
    prompts, answers = rng.integers(0, spec.vocab_size, (2, 300)), rng.integers(0, spec.vocab_size, (2, 3))
    for got, want in zip(device.run_batch(prompts, answers), host.run_batch(prompts, answers), strict=True):
        np.testing.assert_allclose(got.last_logits, want.last_logits, **FP32)
        np.testing.assert_allclose(got.answer_logits, want.answer_logits, **FP32)
        np.testing.assert_allclose(got.stats.density, want.stats.density, rtol=1e-6)
        assert got.stats.sparse.tolist() == want.stats.sparse.tolist() == [False, True, True]
