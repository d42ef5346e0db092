"""How far FlexPrefill's attention output is from dense attention on real q, k, v, and why.

    python bench/prefill_accuracy.py --qkv qkv-32k.npz    # 4 layers, both rules: ~13 min on 2 busy cores
    python bench/prefill_accuracy.py --qkv qkv-32k.npz --layers 10 --rows-per-block 4

The input is a `bench/long_prefill.py --save-qkv` file (float16 q, k, v of some layers of one needle prompt,
read as float32). Per layer, for each budget rule (`coverage`, ours, and `reference`, the official code's
count), the selection `select_blocks` makes with the options given (default: `upcycle eval`'s, γ = 0.95,
τ = 0.1, blocks of 128, min budget 1024) is run through the op's block-sparse path (`bucketed_attention`)
even when the op would fall back to dense, and compared with dense causal attention (`causal_attention_jit`),
both over every query, fp32 at the highest matmul precision. One JSON line; per layer and rule:

- `density` (fraction of causal key blocks selected, mean over heads), `density_H`, `fallback` (the op would
  run dense: mean density > `dense_above`), `query_aware` (the query-aware heads).
- `rel_err_mean` = mean|sparse − dense| / mean|dense| and `rel_err` = max|sparse − dense| / max|dense| over
  all queries, heads and channels (`bench/long_prefill.py`'s fields); `rel_err_mean_H` per head;
  `rel_err_mean_probe` over the probe (the last `block` queries, the rows whose attention the selection is
  computed from) and `rel_err_mean_rest` over the others; `rel_err_mean_by_position`: the others cut into
  `--bins` equal spans of positions, first to last.
- `covered`, on the sampled rows (below): the dense softmax mass that falls inside the selected blocks (what
  the sparse softmax renormalises). `covered_probe_H` and `covered_rest_H`: per head [mean, min] over the
  probe's rows and over the other sampled rows; `covered_by_position`: mean over heads and the sampled rows
  of each span; `rows_below_gamma`: fraction of sampled (row, head) pairs covering less than γ, probe and
  rest. The coverage rule promises only that the probe's mean is ≥ γ for heads that are not query-aware.
- `lost`: where the uncovered mass lies, as fractions of the total uncovered mass over the sampled rows and
  heads, by block offset r − c of the key block from the query's block: `sink` (key block 0: must be 0),
  `offset_1` (the block just before the diagonal), `offset_2_7`, `offset_8_plus`, and `diagonal` (must be 0).
- `err_share_below_gamma`: the share of the summed |sparse − dense| of the sampled rows that comes from the
  (row, head) pairs covering less than γ; `rel_err_mean_at_or_above_gamma` and `rel_err_mean_below_gamma`.
  For one row, sparse − dense = (1 − m)(o_sel − o_out), m the covered mass and o_sel, o_out the attention
  renormalised over the selected and the unselected keys: the error is the lost mass times how far apart
  the two parts' outputs are.
- `selected_sampled`: the selection's blocks per sampled row as a fraction of its causal blocks, mean over
  the probe's rows and the others (compare with `oracle_density` below).
- `exact`: max |ours − numpy| / max|dense| on the sampled rows, numpy being an fp64 softmax over the keys of
  the selected blocks (`flexprefill_reference.attention_rows`: no block lists, slots or padding); so the
  sparse kernel is checked to compute exactly the mask it is given.
- for the reference rule, `port_diff_H`: per head, how many causal blocks differ between our
  `select_blocks(budget_rule="reference")` and the numpy port of the official `get_active_blocks`
  (`tests/flexprefill_reference.py`, fp64), and `port_query_aware_equal`.

Per layer also `dense_exact` (max |causal_attention_jit − numpy dense| / max|dense| on the sampled rows),
`output_to_value` (mean ‖dense output‖ / mean ‖v‖ over rows: a small ratio, attention averaging many values,
makes a relative error large for a given lost mass), `oracle_density` (on the sampled rows, the fewest key
blocks holding γ of each row's own attention, as a fraction of its causal blocks: mean over the probe's
rows, the others, and per head; what a selection made for every query block from its own rows would need,
where FlexPrefill makes one from the last block's rows for all), and `seconds`.

Sampled rows: `--rows-per-block` queries spread evenly over every query block (its first and last included)
and all the probe's rows: 8 per block at 32k is 2,168 rows of 32,768. The covered masses, `lost`, the
error split by γ and `exact` use them (the numpy softmax over every key for every query would take hours on
2 cores); the errors without "sampled" in their description use every query.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from long_prefill import load_qkv

from upcycler.train.model.flexprefill import (
    BUDGET_RULES,
    FlexPrefillOptions,
    bucketed_attention,
    causal_attention_jit,
    select_blocks_jit,
)


def reference_port():
    """tests/flexprefill_reference.py (the numpy port of the official selection), imported from tests/."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import flexprefill_reference

    return flexprefill_reference


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", type=Path, required=True, help="a `long_prefill.py --save-qkv` file")
    parser.add_argument("--layers", default=None, help="comma-separated layers (default: all in the file)")
    parser.add_argument("--rules", default=",".join(BUDGET_RULES), help="budget rules to compare")
    parser.add_argument("--gamma", type=float, default=0.95)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--min-budget", type=int, default=1024)
    parser.add_argument("--max-budget", type=int, default=0)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--dense-above", type=float, default=0.5)
    parser.add_argument("--rows-per-block", type=int, default=8, help="sampled queries per query block")
    parser.add_argument("--bins", type=int, default=8, help="spans of positions for the *_by_position fields")
    return parser.parse_args()


def sample_rows(n: int, block: int, per_block: int) -> np.ndarray:
    """`per_block` rows spread over every query block (first and last included) and all of the probe."""
    nb = math.ceil(n / block)
    starts = np.arange(nb) * block
    ends = np.minimum(starts + block, n) - 1
    spread = np.linspace(0.0, 1.0, per_block)
    rows = np.round(starts[:, None] + spread[None, :] * (ends - starts)[:, None]).astype(np.int64).ravel()
    return np.unique(np.concatenate([rows, np.arange(max(0, n - block), n)]))


def r(x, digits: int = 4):
    return np.round(np.asarray(x, np.float64), digits).tolist()


def rel(diff: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(diff).mean() / np.abs(ref).mean()) if diff.size else float("nan")


def mean_min(x_RH: np.ndarray) -> list:
    """Per head (column), [mean, min] over the rows."""
    return [[round(float(c.mean()), 4), round(float(c.min()), 4)] for c in x_RH.T]


def rule_report(q, k, v, dense, rows, block_mass, opts: FlexPrefillOptions, mask, query_aware, sparse,
                np_sparse, bins: int) -> dict:
    """The fields of one (layer, rule) entry (module docstring)."""
    n, heads, _ = q.shape
    bs, nb = opts.block, opts.blocks(n)
    causal = np.tril(np.ones((nb, nb), bool))
    density_H = mask.sum((1, 2)) / causal.sum()
    diff = sparse - dense
    probe_start = max(0, n - bs)
    position_bin = np.minimum(np.arange(probe_start) * bins // max(probe_start, 1), bins - 1)

    # covered mass of the sampled rows: [R, H]
    row_blocks = rows // bs
    selected_RHn = np.stack([mask[h][row_blocks] for h in range(heads)], axis=1)
    covered_RH = (block_mass * selected_RHn).sum(-1)
    selected_fraction_RH = selected_RHn.sum(-1) / (row_blocks + 1)[:, None]
    probe = rows >= probe_start
    lost_RHn = block_mass * ~selected_RHn
    offset_Rn = row_blocks[:, None] - np.arange(nb)[None, :]
    lost_total = lost_RHn.sum()

    def by_offset(sel_Rn: np.ndarray) -> float:
        return float((lost_RHn * sel_Rn[:, None, :]).sum() / lost_total) if lost_total > 0 else 0.0

    sink = np.zeros((1, nb), bool)
    sink[0, 0] = True
    sink = np.broadcast_to(sink, offset_Rn.shape)

    err_RH = np.abs(sparse[rows] - dense[rows]).sum(-1)
    below = covered_RH < opts.gamma
    dense_RH = np.abs(dense[rows]).sum(-1)
    rest_rows = np.arange(probe_start)
    return {
        "density": round(float(density_H.mean()), 4),
        "density_H": r(density_H, 3),
        "fallback": bool(density_H.mean() > opts.dense_above),
        "query_aware": np.flatnonzero(query_aware).tolist(),
        "rel_err_mean": rel(diff, dense),
        "rel_err": float(np.abs(diff).max() / np.abs(dense).max()),
        "rel_err_mean_H": r([rel(diff[:, h], dense[:, h]) for h in range(heads)]),
        "rel_err_mean_probe": rel(diff[probe_start:], dense[probe_start:]),
        "rel_err_mean_rest": rel(diff[:probe_start], dense[:probe_start]),
        "rel_err_mean_by_position": r([rel(diff[span], dense[span])
                                       for span in (rest_rows[position_bin == b] for b in range(bins))]),
        "covered_probe_H": mean_min(covered_RH[probe]),
        "covered_rest_H": mean_min(covered_RH[~probe]),
        "covered_by_position": r([covered_RH[~probe][position_bin[rows[~probe]] == b].mean()
                                  for b in range(bins)]),
        "rows_below_gamma": {"probe": round(float(below[probe].mean()), 4),
                             "rest": round(float(below[~probe].mean()), 4)},
        "lost": {"sink": by_offset(sink), "diagonal": by_offset(offset_Rn == 0),
                 "offset_1": by_offset(offset_Rn == 1),
                 "offset_2_7": by_offset((offset_Rn >= 2) & (offset_Rn < 8)),
                 "offset_8_plus": by_offset(offset_Rn >= 8),
                 "mean_lost_mass": round(float(1 - covered_RH.mean()), 4)},
        "err_share_below_gamma": round(float(err_RH[below].sum() / err_RH.sum()), 4) if err_RH.sum() else 0.0,
        "rel_err_mean_at_or_above_gamma": round(float(err_RH[~below].sum() / dense_RH[~below].sum()), 4)
        if (~below).any() else None,
        "rel_err_mean_below_gamma": round(float(err_RH[below].sum() / dense_RH[below].sum()), 4)
        if below.any() else None,
        "selected_sampled": {"probe": round(float(selected_fraction_RH[probe].mean()), 4),
                             "rest": round(float(selected_fraction_RH[~probe].mean()), 4)},
        "exact": float(np.abs(sparse[rows] - np_sparse).max() / np.abs(dense).max()),
    }


def oracle_density(block_mass_RHn: np.ndarray, rows: np.ndarray, gamma: float, block: int) -> dict:
    """Per sampled row and head, the fewest key blocks holding γ of that row's own dense attention, as a
    fraction of the row's causal blocks: mean over the probe's rows and over the others, and per head."""
    running = np.cumsum(-np.sort(-block_mass_RHn, axis=-1), axis=-1)
    needed_RH = (running < gamma - 1e-12).sum(-1) + 1
    fraction_RH = needed_RH / (rows // block + 1)[:, None]
    probe = rows >= rows.max() + 1 - block
    return {"probe": round(float(fraction_RH[probe].mean()), 4),
            "rest": round(float(fraction_RH[~probe].mean()), 4), "H": r(fraction_RH.mean(0), 3)}


def layer_report(q, k, v, rules: list[str], base: FlexPrefillOptions, per_block: int, bins: int) -> dict:
    port = reference_port()
    n = q.shape[0]
    bs, nb = base.block, base.blocks(n)
    causal = np.tril(np.ones((nb, nb), bool))
    seconds = {}
    t = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        dense = np.asarray(causal_attention_jit(q, k, v), np.float64)
    seconds["dense"] = round(time.perf_counter() - t, 2)
    selections, outputs = {}, {}
    for rule in rules:
        opts = dataclasses.replace(base, budget_rule=rule)
        t = time.perf_counter()
        with jax.default_matmul_precision("highest"):
            sel = select_blocks_jit(q, k, opts)
            mask = np.asarray(sel.mask_Hnn)
            out = bucketed_attention(q, k, v, sel.mask_Hnn, mask.sum(-1), bs)
            outputs[rule] = np.asarray(out, np.float64)
        selections[rule] = (mask, np.asarray(sel.query_aware_H))
        seconds[rule] = round(time.perf_counter() - t, 2)
    rows = sample_rows(n, bs, per_block)
    qn, kn, vn = (np.asarray(x) for x in (q, k, v))
    t = time.perf_counter()
    np_dense, block_mass, np_sparse = port.attention_rows(qn, kn, vn, rows, block=bs,
                                                          masks=tuple(selections[rule][0] for rule in rules))
    seconds["numpy_rows"] = round(time.perf_counter() - t, 2)
    entry = {
        "dense_exact": float(np.abs(dense[rows] - np_dense).max() / np.abs(dense).max()),
        "output_to_value": round(float(np.linalg.norm(dense, axis=-1).mean()
                                       / np.linalg.norm(vn.astype(np.float64), axis=-1).mean()), 4),
        "oracle_density": oracle_density(block_mass, rows, base.gamma, bs),
    }
    for i, rule in enumerate(rules):
        mask, query_aware = selections[rule]
        opts = dataclasses.replace(base, budget_rule=rule)
        entry[rule] = rule_report(qn, kn, vn, dense, rows, block_mass, opts, mask, query_aware, outputs[rule],
                                  np_sparse[i], bins)
        if rule == "reference":
            t = time.perf_counter()
            upper = base.blocks(base.max_budget) if base.max_budget else nb
            want = port.reference_selection(qn, kn, block=bs, gamma=base.gamma, tau=base.tau,
                                            min_budget_blocks=base.blocks(base.min_budget),
                                            max_budget_blocks=upper)
            seconds["port"] = round(time.perf_counter() - t, 2)
            entry[rule]["port_diff_H"] = ((mask ^ want.mask_Hnn) & causal).sum((1, 2)).tolist()
            entry[rule]["port_query_aware_equal"] = bool((query_aware == want.query_aware_H).all())
    entry["seconds"] = seconds
    return entry


def main() -> None:
    args = parse_args()
    length, qkv = load_qkv(args.qkv)
    layers = sorted(qkv) if args.layers is None else [int(x) for x in args.layers.split(",")]
    rules = args.rules.split(",")
    base = FlexPrefillOptions(gamma=args.gamma, tau=args.tau, block=args.block, min_budget=args.min_budget,
                              max_budget=args.max_budget, dense_above=args.dense_above)
    n = next(iter(qkv.values()))[0].shape[0]
    start = time.perf_counter()
    per_layer = {str(layer): layer_report(*qkv[layer], rules, base, args.rows_per_block, args.bins)
                 for layer in layers}
    print(json.dumps({
        "bench": "prefill_accuracy", "length": length, "qkv": args.qkv.name, "layers": layers,
        "options": dataclasses.asdict(base), "rules": rules,
        "rows_sampled": len(sample_rows(n, args.block, args.rows_per_block)), "per_layer": per_layer,
        "seconds": round(time.perf_counter() - start, 1), "load_1min": os.getloadavg()[0],
    }), flush=True)


if __name__ == "__main__":
    main()
