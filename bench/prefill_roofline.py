"""FlexPrefill's attention on a TPU chip, bounded from compiled executables: `long_prefill.py --topology`.

For one layer's real q, k (a prompt of N tokens) and a TPU generation, three ways to attend, each charged
by `upcycler.train.model.flexprefill_cost` (FLOPs, HBM bytes and every kernel step at `TPU_STEP_S`, the
Pallas TPU guide's 0.35 µs):

- `dense`: dense causal splash attention in 512-token tiles (`flexprefill_splash.dense_attention`), the
  baseline; its grid steps include the empty ones above the diagonal, which splash iterates.
  `dense_nonempty_steps_s` charges only the tiles it computes, the strictest dense figure.
- `grouped`: FlexPrefill's selection then the grouped kernel (`flexprefill_tpu`): a key head's query heads
  together, each row's selected blocks walked in slabs, one grid step per (key head, query block). This
  is what `upcycle eval` runs where the model predicts it beats dense.
- `splash_selection`: the selection's blocks through splash per query head in the narrowest fixed-width
  grid that holds the densest row (the earlier TPU path), for comparison.

The selection (`flexprefill.select_blocks`) is compiled for the chip: its FLOPs are XLA's count (the
program has no loop), its HBM bytes the compile report's walk of the optimised HLO
(`upcycler.train.aot.hbm_traffic`). A layer without query-aware heads is charged the program without the
query-aware branch (τ = 0), which is what runs; one with them is charged the whole program, both branches
of its `cond` counted (the pooled blocks: a threshold search of six passes over nb² entries per head, 1M
at 128k, each pass charged its reads by the walk). The XLA work around each kernel (padding, folding the batch into the
heads, step tables, the output's transpose) is charged the same way from its compiled program, the
kernels left out of the walk (their traffic depends on the mask: the cost model counts it). Inputs are
bf16, what a TPU prefill would use. `ratio` = dense / what the device prefill runs, step costs included:
the selection, then the grouped kernel and the XLA work around it, or dense after a fallback (a selection
over `dense_above`) or where the model predicts dense faster (`chosen`); `ratio_without_steps` is the
grouped path's with every step cost dropped from both sides.

These are bounds and estimates, not measurements: each kernel is assumed to reach the roofline of its
FLOPs and bytes, plus the stated cost per step.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from upcycler import hardware
from upcycler.train.aot.topology import parse_slice, tpu_devices
from upcycler.train.model import flexprefill_cost as cost
from upcycler.train.model import flexprefill_splash as fs
from upcycler.train.model import flexprefill_tpu as tpu
from upcycler.train.model.flexprefill import FlexPrefillOptions, select_blocks


def _compile(fn, shapes, chip: str):
    """`fn` compiled for one chip of generation `chip`, and that chip's figures."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = tpu_devices(parse_slice(f"{chip}-{8 if chip in ('v4', 'v5p') else 4}"))
    mesh = Mesh(devices[:1], ("chip",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, PartitionSpec())) for s, d in shapes]
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled, hardware.for_devices(devices), time.perf_counter() - start


def _outside_kernels(compiled) -> dict:
    """The HBM bytes of a program's XLA work, its kernels left out, and its compiled temporaries."""
    from upcycler.train.aot.hbm_traffic import charges, hbm_bytes

    text = compiled.as_text()
    kernels = sum(c.total for c in charges(text) if c.is_kernel)
    return {"hbm_bytes": hbm_bytes(text) - kernels,
            "temp_gib": round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3)}


def _selection_costs(compiled) -> dict:
    from upcycler.train.aot.hbm_traffic import hbm_bytes

    cost = compiled.cost_analysis() or {}
    return {"flops": float(cost.get("flops", 0.0)), "hbm_bytes": hbm_bytes(compiled.as_text()),
            "bytes_by_xla": float(cost.get("bytes accessed", 0.0)),
            "temp_gib": round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3)}


def _work(w: cost.KernelWork, rates: cost.ChipRates) -> dict:
    return {"flops": float(w.flops), "bytes": float(w.bytes), "grid_steps": int(w.grid_steps),
            "iterations": int(w.iterations), "seconds": float(w.seconds(rates))}


def layer_bound(q_NHh, k_NKh, opts: FlexPrefillOptions, chip_name: str, compiled: dict) -> dict:
    """The comparison of one layer (module docstring); `compiled` caches executables by shape."""
    N, H, h = q_NHh.shape
    K = k_NKh.shape[1]
    nb = opts.blocks(N)
    with jax.default_matmul_precision("highest"):
        selection = jax.jit(select_blocks, static_argnames="opts")(q_NHh, k_NKh, opts)
    mask_Hnn, query_aware = np.asarray(selection.mask_Hnn), int(np.asarray(selection.query_aware_H).sum())
    mask_BHnn = mask_Hnn[None]
    causal = nb * (nb + 1) / 2
    union_Knn = mask_Hnn.reshape(K, H // K, nb, nb).any(1) | np.eye(nb, dtype=bool)
    width = next(w for w in tpu.step_widths(nb) if w >= int(union_Knn.sum(-1).max()))
    bf = jnp.bfloat16
    qkv = [((1, N, H, h), bf), ((1, N, K, h), bf), ((1, N, K, h), bf)]
    if (N, H, K, h, chip_name) not in compiled:
        compiled[(N, H, K, h, chip_name)] = {
            "select": _compile(lambda q, k: select_blocks(q, k, opts), [((N, H, h), bf), ((N, K, h), bf)], chip_name),
            # without the query-aware branch (τ = 0): what runs when no head is query-aware
            "select_vertical_slash": _compile(lambda q, k: select_blocks(q, k, dataclasses.replace(opts, tau=0.0)),
                                              [((N, H, h), bf), ((N, K, h), bf)], chip_name),
            "dense": _compile(lambda q, k, v: fs.dense_attention(q, k, v), qkv, chip_name),
        }
    if (N, H, K, h, chip_name, width) not in compiled:  # the width the selection runs (one branch of the program)
        compiled[(N, H, K, h, chip_name, width)] = _compile(
            lambda q, k, v, m: tpu.block_sparse_attention(q, k, v, m, opts.block, widths=(width,)),
            [*qkv, ((1, H, nb, nb), jnp.bool_)], chip_name)
    programs = compiled[(N, H, K, h, chip_name)]
    grouped_program = compiled[(N, H, K, h, chip_name, width)]
    chip = programs["select"][1]
    rates = cost.ChipRates.of(chip)
    bare = cost.ChipRates(rates.peak_flops, rates.hbm_bandwidth, 0.0)

    # the branch that runs: the query-aware heads' pooled blocks only when some head is query-aware (that
    # program's HLO walk counts both branches of its cond)
    select = _selection_costs(programs["select" if query_aware else "select_vertical_slash"][0])
    select_s = max(select["flops"] / rates.peak_flops, select["hbm_bytes"] / rates.hbm_bandwidth)
    around_grouped, around_dense = _outside_kernels(grouped_program[0]), _outside_kernels(programs["dense"][0])
    grouped = cost.grouped_sparse(mask_BHnn, K, opts.block, h, tpu.SLAB)
    dense = cost.dense_causal(1, N, H, h, fs.DENSE_TILE)
    splash_width = next(w for w in tpu.step_widths(nb) if w >= int((mask_Hnn | np.eye(nb, dtype=bool)).sum(-1).max()))
    splash = cost.per_head_sparse(mask_BHnn, opts.block, h)._replace(grid_steps=H * nb * splash_width)
    seconds = {
        "selection": select_s,
        "around_grouped": around_grouped["hbm_bytes"] / rates.hbm_bandwidth,
        "grouped_kernel": float(grouped.seconds(rates)),
        "around_dense": around_dense["hbm_bytes"] / rates.hbm_bandwidth,
        "dense_kernel": float(dense.seconds(rates)),
        "splash_selection_kernel": float(splash.seconds(rates)),
    }
    dense_s = seconds["around_dense"] + seconds["dense_kernel"]
    nt = -(-N // fs.DENSE_TILE)
    nonempty = seconds["around_dense"] + float(dense._replace(grid_steps=nt * (nt + 1) // 2 * H).seconds(rates))
    # what the device prefill runs for this prompt: a selection over `dense_above` falls back to dense; else
    # the grouped kernel where the model predicts it beats dense charged its computed tiles alone
    fallback = bool(opts.runs_dense(N) or mask_Hnn.sum() / (H * causal) > opts.dense_above)
    chosen = "sparse" if not fallback and seconds["grouped_kernel"] < nonempty - seconds["around_dense"] else "dense"
    flexprefill_s = seconds["selection"] + (seconds["around_grouped"] + seconds["grouped_kernel"] if chosen == "sparse"
                                            else dense_s)
    without_steps = ((seconds["around_dense"] + float(dense.seconds(bare)))
                     / (seconds["selection"] + seconds["around_grouped"] + float(grouped.seconds(bare))))
    return {
        "density": round(float(mask_Hnn.sum() / (H * causal)), 4), "query_aware_heads": query_aware,
        "union_density": round(float(union_Knn.sum() / (K * causal)), 4),
        "step_s": rates.step_s, "width": width,
        "selection": {k: v for k, v in select.items() if k != "temp_gib"},
        "kernels": {"grouped": _work(grouped, rates), "dense": _work(dense, rates),
                    "splash_selection": _work(splash, rates)},
        "around_kernels_bytes": {"grouped": around_grouped["hbm_bytes"], "dense": around_dense["hbm_bytes"]},
        "seconds": {**seconds, "flexprefill": flexprefill_s, "dense": dense_s,
                    "grouped": seconds["selection"] + seconds["around_grouped"] + seconds["grouped_kernel"],
                    "dense_nonempty_steps": nonempty,
                    "splash_selection": seconds["selection"] + seconds["splash_selection_kernel"]},
        "ratio": round(dense_s / flexprefill_s, 3),
        "ratio_vs_dense_nonempty_steps": round(nonempty / flexprefill_s, 3),
        "ratio_without_steps": round(without_steps, 3),
        "ratio_splash_selection": round(dense_s / (seconds["selection"] + seconds["splash_selection_kernel"]), 3),
        "fallback": fallback, "chosen": chosen,
        "temp_gib": {"select": select["temp_gib"], "grouped": around_grouped["temp_gib"],
                     "dense": around_dense["temp_gib"]},
        "compile_s": {"select": round(programs["select"][2] + programs["select_vertical_slash"][2], 1),
                      "grouped": round(grouped_program[2], 1),
                      "dense": round(programs["dense"][2], 1)},
    }
