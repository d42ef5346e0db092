"""FlexPrefill's grouped TPU kernel (`flexprefill_tpu`), run by the Pallas TPU interpreter, and the cost
model that chooses it (`flexprefill_cost`).

The kernel computes what the CPU path computes on the same block masks: grouped-query (G = 2 and 3) and
multi-head, lengths on and off the block grid, heads of one key head selecting different blocks, a batch
whose prompts fall back differently (one causal mask, one sparse), step tables split across several
kernel calls (the next row's first slab fetched across a call's rows, and rows of padding past the last
block), and a sliding window through a band mask. The cost model counts what the kernels do by hand-counted
masks, and the device prefill chooses dense where the model predicts it faster and says so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flexprefill_splash import BLOCK, FP32, block_masks, host_sparse, qkv

from upcycler import hardware
from upcycler.train.model import flexprefill as fp
from upcycler.train.model import flexprefill_cost as cost
from upcycler.train.model import flexprefill_device as fd
from upcycler.train.model import flexprefill_splash as fs
from upcycler.train.model import flexprefill_tpu as tpu

V5E = cost.ChipRates.of(next(c for c in hardware.chips() if c.name == "TPU v5e"))


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


def test_step_tables_hold_the_union_diagonal_first_with_each_heads_bits():
    mask = np.zeros((1, 2, 3, 3), bool)  # one key head, G = 2, three blocks
    mask[0, 0, 2, [0, 2]] = True  # head 0, row 2: the sink and the diagonal
    mask[0, 1, 2, [1, 2]] = True  # head 1, row 2: block 1 and the diagonal
    entries, count = tpu.step_tables(jnp.asarray(mask), 1, 3, rows=4)
    ids, bits = np.asarray(entries) & ((1 << 20) - 1), np.asarray(entries) >> 20
    assert count.tolist() == [[1, 1, 3, 1]]  # the diagonal alone, then the union; a padding row lists one
    assert ids[0, 2, :3].tolist() == [2, 0, 1] and bits[0, 2, :3].tolist() == [0b11, 0b01, 0b10]
    assert bits[0, 2, 3:].tolist() == [0] * (entries.shape[-1] - 3)  # slots past the count select nothing
    assert ids[0, 0, 0] == 0 and bits[0, 0, 0] == 0b11  # the diagonal is every head's
    assert ids[0, 3, 0] == 0 and bits[0, 3, 0] == 0b11  # the padding row reads block 0 for every head


def test_cost_model_counts_by_hand():
    """The counts of a hand-built selection: N = 1024 in 8 blocks, H = 4 query heads on K = 2 key heads."""
    mask = np.zeros((1, 4, 8, 8), bool)
    mask[0, 0, 7, :5] = True  # key head 0, row 7: head 0 lists blocks 0-4, head 1 blocks 3-6
    mask[0, 1, 7, 3:7] = True
    grouped = cost.grouped_sparse(mask, 2, 128, 64, slab=4)
    # union per (key head, row): 1 (the diagonal) everywhere except key head 0's row 7: blocks 0-7, 8 of them
    assert int(grouped.grid_steps) == 16 and int(grouped.iterations) == 15 + 2
    assert float(grouped.flops) == 4.0 * 256 * 512 * 64 * 17
    assert float(grouped.bytes) == 17 * 2 * 512 * 64 * 2 + 16 * 2 * 256 * 64 * 2
    dense = cost.dense_causal(1, 1024, 4, 64, tile=512)
    assert dense.grid_steps == 4 * 2 * 2 and dense.flops == 4.0 * 512 * 512 * 64 * 4 * 3
    seconds = float(dense.seconds(V5E))
    assert seconds == pytest.approx(max(dense.flops / V5E.peak_flops, dense.bytes / V5E.hbm_bandwidth) + 16 * 0.35e-6)


def test_the_model_prefers_sparse_for_long_sparse_prompts_only():
    """At 32k a selection of sink, diagonal and a few slashes (density ~3%) is predicted several times
    faster than dense splash on a v5e, even charged its computed tiles alone (the figure the choice uses);
    every causal block selected costs the grouped kernel about dense's FLOPs and over 4× the sparse time."""
    nb, H, K = 256, 9, 3
    r, c = np.arange(nb)[:, None], np.arange(nb)[None, :]
    sparse = np.broadcast_to((c <= r) & ((c == 0) | (r - c < 8)), (1, H, nb, nb))
    full = np.broadcast_to(c <= r, (1, H, nb, nb))
    dense_s = float(cost.dense_causal(1, nb * 128, H, 64, fs.DENSE_TILE, empty_steps=False).seconds(V5E))
    splash_s = float(cost.dense_causal(1, nb * 128, H, 64, fs.DENSE_TILE).seconds(V5E))
    sparse_s = float(cost.grouped_sparse(sparse, K, 128, 64, tpu.SLAB).seconds(V5E))
    assert sparse_s < dense_s / 3 < splash_s / 3
    full_work = cost.grouped_sparse(full, K, 128, 64, tpu.SLAB)
    assert float(full_work.seconds(V5E)) > 4 * sparse_s
    dense_flops = cost.dense_causal(1, nb * 128, H, 64, 128).flops  # causal in the kernel's 128-token blocks
    assert 1 <= float(full_work.flops) / dense_flops < 1.05  # rows rounded up to whole slabs


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
