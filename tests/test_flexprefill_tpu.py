"""FlexPrefill's grouped TPU kernel (`flexprefill_tpu`), run by the Pallas TPU interpreter, and the cost
model that chooses it (`flexprefill_cost`).

The kernel computes what the CPU path computes on the same block masks: grouped-query (G = 2 and 3) and
multi-head, lengths on and off the block grid, heads of one key head selecting different blocks, a batch
whose prompts fall back differently (one causal mask, one sparse), step tables split across several
kernel calls (the next row's first slab fetched across a call's rows, and rows of padding past the last
block), and a sliding window through a band mask. The device prefill chooses dense where the cost model
predicts it faster, and says so. (The step tables and the cost model alone: test_flexprefill_cost.py.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flexprefill_splash import BLOCK, FP32, block_masks, host_sparse, qkv

from upcycler.train.model import flexprefill as fp
from upcycler.train.model import flexprefill_device as fd
from upcycler.train.model import flexprefill_tpu as tpu


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("heads,kv_heads,n,kind", [(4, 2, 640, "random"), (6, 2, 600, "random"),
                                                   (4, 4, 600, "sink_and_diagonal")],
                         ids=["gqa2-aligned", "gqa3-unaligned", "mha-narrow"])
def test_grouped_kernel_equals_the_sparse_path(heads, kv_heads, n, kind, monkeypatch):
    """Random masks differ between the heads of one key head (each head keeps its own softmax); step tables
    of two query blocks' rows per call (several calls per key head, padding rows in the last)."""
    q, k, v = qkv(0, 2, n, heads, kv_heads)
    nb = fp.FlexPrefillOptions(block=BLOCK).blocks(n)
    mask = block_masks(1, 2, heads, nb, kind)
    width = next(w for w in tpu.step_widths(nb) if w >= int(mask.sum(-1).max()))
    assert (kind == "random") == (width == nb)  # the narrow masks run a narrower table
    monkeypatch.setattr(tpu, "SMEM_ENTRIES", 2 * -(-width // tpu.SLAB) * tpu.SLAB)
    got = tpu.block_sparse_attention(q, k, v, jnp.asarray(mask), BLOCK, interpret=True)
    np.testing.assert_allclose(got, host_sparse(q, k, v, mask), **FP32)


def test_a_fallback_prompt_beside_a_sparse_one():
    """One prompt's mask is causal (a prompt that fell back), the other's sparse: each equals its own path,
    the first equals dense causal attention."""
    q, k, v = qkv(2, 2, 1100, 6, 2)
    nb = fp.FlexPrefillOptions(block=BLOCK).blocks(1100)
    mask = block_masks(3, 2, 6, nb, "random")
    mask[0] = np.tril(np.ones((nb, nb), bool))
    got = tpu.block_sparse_attention(q, k, v, jnp.asarray(mask), BLOCK, interpret=True)
    np.testing.assert_allclose(got, host_sparse(q, k, v, mask), **FP32)
    np.testing.assert_allclose(got[0], fp.causal_attention(q[0], k[0], v[0]), **FP32)


def test_a_band_mask_with_a_window_equals_the_windowed_path():
    q, k, v = qkv(3, 1, 600, 4, 2)
    nb = fp.FlexPrefillOptions(block=BLOCK).blocks(600)
    r, c = np.arange(nb)[:, None], np.arange(nb)[None, :]
    band = np.broadcast_to((c <= r) & (r - c <= 2), (1, 4, nb, nb))  # 200 keys reach at most 2 blocks back
    got = tpu.block_sparse_attention(q, k, v, jnp.asarray(band), BLOCK, window=200, interpret=True)
    np.testing.assert_allclose(got[0], fp.causal_attention(q[0], k[0], v[0], window=200), **FP32)


def test_auto_runs_dense_where_predicted_faster_and_says_so():
    """At 1,280 tokens the model predicts dense splash faster than the grouped kernel on any selection: the
    batch runs dense (density 1, no query-aware head, `sparse` false) and equals dense attention; the same
    batch with `kernel="sparse"` runs the selection."""
    q, k, v = qkv(4, 1, 1280, 4, 2)
    opts = fp.FlexPrefillOptions(block=BLOCK, gamma=0.5, min_budget=BLOCK, tau=0.0, dense_above=1.0)
    auto = jax.jit(lambda *a: fd.flexprefill_attention(*a, opts, interpret=True))(q, k, v)
    assert not bool(auto.sparse) and (np.asarray(auto.density_BH) == 1).all()
    np.testing.assert_allclose(auto.out_BNHh[0], fp.causal_attention(q[0], k[0], v[0]), **FP32)
    forced = fd.flexprefill_attention(q, k, v, dataclasses.replace(opts, kernel="sparse"), interpret=True)
    assert bool(forced.sparse) and (np.asarray(forced.density_BH) < 1).all()
