"""The grouped TPU kernel's step tables and the cost model behind FlexPrefill's kernel choice
(`flexprefill_tpu.step_tables`, `flexprefill_cost`), without running a kernel: the tables hold each row's
union diagonal first with every head's selection bits; the model's counts equal hand counts; and on a
32k prompt it prefers the sparse kernel for a sparse selection only.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from upcycler import hardware
from upcycler.train.model import flexprefill_cost as cost
from upcycler.train.model import flexprefill_splash as fs
from upcycler.train.model import flexprefill_tpu as tpu

V5E = cost.ChipRates.of(next(c for c in hardware.chips() if c.name == "TPU v5e"))


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
