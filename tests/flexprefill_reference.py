"""FlexPrefill's block selection as the official code does it, in numpy, kept for parity tests only.

This ports `get_active_blocks` from `flex_prefill/ops/flex_prefill_attention.py` in `bytedance/FlexPrefill`
(HEAD a24b27b, L1661), together with the helpers it calls there: `score_cover_topk`, `score_cover_idx`,
`sum_all_diagonal_matrix`, `torch_bhn_sumpool`, `triton_bnhd_pool` ("avg") and `transform_veritcal_slash_idx`.
`flex_prefill_attention` (L1791) turns token budgets into block budgets with ceil(tokens / block) before it
calls `get_active_blocks`, and sends prompts of N <= max(2·block, ceil(min_budget / block)·block) to dense
attention; that rule lives in the tests, not here. Batch size 1, GQA not interleaved (query head i reads kv
head i // G), q and k after RoPE and not yet scaled. The arithmetic is fp64 unless `dtype` says otherwise;
the official code runs the softmaxes, sums and sorts in fp32 on bf16 inputs.

What it reproduces, quirks included:

- Probe: the last `block` queries (the last `block` tokens, which straddle two query blocks when `block`
  does not divide N), scaled by h^-1/2, causal softmax over all N keys.
- Vertical: the probe rows' mean, one value per key token. Slash: the sum of each diagonal of the probe
  divided by `block`; token index t holds distance N-1-t, so the last entry is the main diagonal.
- Budgets: 1 + the number of sorted token scores whose running sum stays <= gamma, then `// 128 + 1`.
  128 is hard-coded and is not the block size, so the count is a number of 128-token units plus one, even
  when block = 64. The counts are raised to `min_budget_blocks`, then lowered to min(`max_budget_blocks`,
  nb); the upper clamp wins when the two cross.
- Pooling: vertical and slash are right-padded with zeros to nb·block tokens and summed per block. For the
  slash, pooled block s becomes the diagonal offset o = nb-1-s. When block does not divide N (pad
  p = nb·block - N), offset o therefore covers token distances o·block - p ... (o+1)·block - 1 - p, not
  o·block ... (o+1)·block - 1.
- Pattern choice: the estimate softmax(mean of the scaled probe queries · per-block key means) over all nb
  blocks, with a partial last key block averaged over its real tokens, against the pooled vertical.
  sqrt(JSD) < tau makes the head query-aware (a NaN distance, from a zero pooled entry, does not).
  A query-aware head's vertical and slash counts become `min_budget_blocks` exactly (no upper clamp).
- Vertical-slash blocks: the sink column (pooled vertical 0) and the main diagonal (offset 0) are forced
  in by an infinite score. Top-k over the pooled scores with k = min(largest count over heads, nb); a
  head's entries past its own count become column 0 and offset 0. Column c lists (r, c) for r >= c;
  offset o lists (c + o, c) while c + o < nb. Anything that falls outside becomes flat index 0, block
  (0, 0), which every head lists anyway.
- Query-aware blocks (only those heads): per-block query means (a partial last block averaged over its real
  tokens) scaled by h^-1/2 against the per-block key means, a block-causal softmax per row (each row sums
  to 1, nb in all), flattened over the nb² blocks and sorted. The prefix whose running sum stays <=
  gamma·nb is kept, a global budget per head, not one per row; the other entries become flat index 0.
  These blocks are joined to the head's min-budget vertical-slash blocks.

Blocks above the diagonal (c > r). The vertical and slash paths never list one. The query-aware path can:
the masked entries have probability 0, sort last, and share the running sum of all nb rows, so they are
kept exactly when that sum is <= gamma·nb. For gamma < 1 that never happens (the sum is nb, up to
rounding). At gamma = 1 it holds in exact arithmetic, so every block with c > r is listed (the official
code run on CPU torch listed them all), but in floating point it depends on how the sum rounds; this port in
fp64 drops them for some heads, together with the last causal block before the cut. This port returns what
its own arithmetic gives. Callers compare only within c <= r and avoid query-aware heads at gamma = 1.

Rounding. Three cuts compare a computed value with a bound: the token counts (<= gamma), the query-aware
prefix (<= gamma·nb) and the pattern choice (< tau). Inputs that put a sum on its bound within rounding
decide differently in fp32 and fp64. That happens by construction at gamma = 1, where all the mass is
counted, and when gamma·nb is an integer and attention is diffuse: the early rows' entries are then the
largest, so the sorted prefix is made of whole rows and its sum is an integer. Parity cases avoid both.
In fp64 (the default) a probability that the official fp32 softmax flushes to zero stays positive, so the
NaN distance of a zero pooled entry needs dtype=np.float32.

Zero min budget. With `min_budget_blocks` = 0 a query-aware head's vertical and slash counts are 0, but the
top-k lists are as long as the largest count of any head and a head's unused entries become column 0 and
offset 0. So a query-aware head still lists the sink column and the diagonal, unless every head is
query-aware (then the lists are empty and only its pooled blocks are listed).

Ties: torch's top-k and sort do not fix an order among equal scores; this port takes the lower index first
(stable sorts). Equal pooled scores do not occur with continuous random inputs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


class ReferenceSelection(NamedTuple):
    """What `get_active_blocks` computes for one prompt, head by head (H query heads, nb blocks)."""

    mask_Hnn: np.ndarray           # bool [H, nb, nb]: flat index r·nb + c listed for head h
    query_aware_H: np.ndarray      # bool [H]: sqrt(JSD) < tau
    distance_H: np.ndarray         # sqrt(JSD) between the pooled estimate and the pooled vertical
    vertical_Hn: np.ndarray        # the pooled vertical (sums to 1 per head), before the sink is forced in
    slash_Hn: np.ndarray           # the pooled slash; entry s is diagonal offset nb-1-s
    vertical_count_H: np.ndarray   # vertical blocks taken (after the clamps and the query-aware override)
    slash_count_H: np.ndarray      # slash blocks taken (the same)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def _cover_count(scores: np.ndarray, gamma: float) -> np.ndarray:
    """`score_cover_topk`: 1 + how many of the largest scores fit, in order, within a running sum of gamma."""
    running = np.cumsum(-np.sort(-scores, axis=-1), axis=-1)
    return np.sum(running <= gamma, axis=-1) + 1


def _cover_indices(scores: np.ndarray, budget: float) -> np.ndarray:
    """`score_cover_idx` on a 1-d array: indices by falling score; those past a running sum of `budget` -> 0."""
    order = np.argsort(-scores, kind="stable")
    running = np.cumsum(scores[order])
    return np.where(running > budget, 0, order)


def _diagonal_sums(a_Hqn: np.ndarray) -> np.ndarray:
    """`sum_all_diagonal_matrix` for q probe rows over n keys: out[t] = sum_i a[i, t - (q-1-i)].

    Row i is query N-q+i, so entry t collects distance N-1-t; terms left of key 0 are zero padding.
    """
    _, rows, n = a_Hqn.shape
    out = np.zeros((a_Hqn.shape[0], n), a_Hqn.dtype)
    for i in range(rows):
        shift = rows - 1 - i
        out[:, shift:] += a_Hqn[:, i, : n - shift]
    return out


def _sum_pool(x_Hn: np.ndarray, block: int) -> np.ndarray:
    """`torch_bhn_sumpool`: right-pad with zeros to a multiple of `block`, sum each block."""
    heads, n = x_Hn.shape
    nb = math.ceil(n / block)
    padded = np.zeros((heads, nb * block), x_Hn.dtype)
    padded[:, :n] = x_Hn
    return padded.reshape(heads, nb, block).sum(-1)


def _block_means(x_NKh: np.ndarray, block: int) -> np.ndarray:
    """Per-block means over the sequence; a partial last block is averaged over its real tokens.

    This is `triton_bnhd_pool(..., "avg")` (it divides by the block's real length), and equally the query
    pooling in the query-aware branch (zero padding, mean over `block`, last block rescaled by block/real).
    """
    n = x_NKh.shape[0]
    nb = math.ceil(n / block)
    return np.stack([x_NKh[b * block: (b + 1) * block].mean(0) for b in range(nb)])


def _sqrt_js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """`square_root_js_divergence` along the last axis; a zero entry gives NaN as in torch (0·log 0)."""
    m = (p + q) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(0.5 * np.sum(p * np.log(p / m), -1) + 0.5 * np.sum(q * np.log(q / m), -1))


def reference_selection(
    q_NHh: np.ndarray,
    k_NKh: np.ndarray,
    *,
    block: int,
    gamma: float,
    tau: float,
    min_budget_blocks: int,
    max_budget_blocks: int,
    dtype: type = np.float64,
) -> ReferenceSelection:
    """Everything `get_active_blocks` decides for one prompt; see the module docstring for the rules."""
    q = np.asarray(q_NHh, dtype)
    k = np.asarray(k_NKh, dtype)
    n, heads, head_dim = q.shape
    group = heads // k.shape[1]
    if heads != group * k.shape[1] or k.shape[0] != n:
        raise ValueError(f"q {q.shape} and k {k.shape} do not pair up")
    if n < block:
        raise ValueError(f"the probe needs at least one full block: N={n} < block={block}")
    nb = math.ceil(n / block)
    max_blocks = min(max_budget_blocks, nb)
    k_NHh = np.repeat(k, group, axis=1)
    scale = dtype(1.0 / math.sqrt(head_dim))

    # the probe: the last `block` queries against every key, causal
    probe_qHh = q[-block:] * scale
    logits_Hqn = np.einsum("ihd,jhd->hij", probe_qHh, k_NHh)
    query_pos = n - block + np.arange(block)
    logits_Hqn = np.where(np.arange(n)[None, :] > query_pos[:, None], -np.inf, logits_Hqn)
    probs_Hqn = _softmax(logits_Hqn)
    vertical_tok = probs_Hqn.mean(1)
    slash_tok = _diagonal_sums(probs_Hqn) / block

    # budgets, in blocks, from token counts
    vertical_count = _cover_count(vertical_tok, gamma) // 128 + 1
    slash_count = _cover_count(slash_tok, gamma) // 128 + 1
    vertical_count = np.minimum(np.maximum(vertical_count, min_budget_blocks), max_blocks)
    slash_count = np.minimum(np.maximum(slash_count, min_budget_blocks), max_blocks)

    vertical_Hn = _sum_pool(vertical_tok, block)
    slash_Hn = _sum_pool(slash_tok, block)

    # pattern choice
    key_means_nHh = np.repeat(_block_means(k, block), group, axis=1)
    estimate_Hn = _softmax(np.einsum("hd,bhd->hb", probe_qHh.mean(0), key_means_nHh))
    distance_H = _sqrt_js_divergence(estimate_Hn, vertical_Hn)
    with np.errstate(invalid="ignore"):
        query_aware_H = distance_H < tau
    vertical_count = np.where(query_aware_H, min_budget_blocks, vertical_count)
    slash_count = np.where(query_aware_H, min_budget_blocks, slash_count)

    # vertical-slash blocks, sink and diagonal forced
    v_scores = vertical_Hn.copy()
    v_scores[:, 0] = np.inf
    s_scores = slash_Hn.copy()
    s_scores[:, -1] = np.inf
    take_v = min(int(vertical_count.max()), nb)
    take_s = min(int(slash_count.max()), nb)
    rows = np.arange(nb)
    mask_Hnn = np.zeros((heads, nb, nb), bool)
    listed_Hm = mask_Hnn.reshape(heads, nb * nb)  # a view: flat index r·nb + c
    for h in range(heads):
        columns = np.argsort(-v_scores[h], kind="stable")[:take_v]
        columns = np.where(np.arange(take_v) < vertical_count[h], columns, 0)
        offsets = (nb - 1) - np.argsort(-s_scores[h], kind="stable")[:take_s]
        offsets = np.where(np.arange(take_s) < slash_count[h], offsets, 0)
        flat = []
        for c in columns:
            listed = rows * nb + c
            flat.append(np.where(rows < c, 0, listed))
        for o in offsets:
            listed = (rows + o) * nb + rows
            flat.append(np.where(listed >= nb * nb, 0, listed))
        if flat:
            listed_Hm[h, np.unique(np.concatenate(flat))] = True

    # query-aware blocks
    if query_aware_H.any():
        query_means_nHh = _block_means(q, block)
        causal_nn = np.tril(np.ones((nb, nb), bool))
        for h in np.flatnonzero(query_aware_H):
            logits_nn = (query_means_nHh[:, h] * scale) @ key_means_nHh[:, h].T
            attn = _softmax(np.where(causal_nn, logits_nn, -np.inf)).reshape(-1)
            listed_Hm[h, _cover_indices(attn, gamma * nb)] = True

    return ReferenceSelection(mask_Hnn, query_aware_H, distance_H, vertical_Hn, slash_Hn,
                              vertical_count, slash_count)


def reference_block_mask(
    q_NHh: np.ndarray,
    k_NKh: np.ndarray,
    *,
    block: int,
    gamma: float,
    tau: float,
    min_budget_blocks: int,
    max_budget_blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(mask [H, nb, nb], query_aware [H]): the blocks `get_active_blocks` lists for each head, in fp64.

    mask[h, r, c] is True when the official code lists flat index r·nb + c for head h. Blocks with c > r
    are returned as listed (see the module docstring: only query-aware heads at gamma = 1 can list them).
    """
    sel = reference_selection(q_NHh, k_NKh, block=block, gamma=gamma, tau=tau,
                              min_budget_blocks=min_budget_blocks, max_budget_blocks=max_budget_blocks)
    return sel.mask_Hnn, sel.query_aware_H


def attention_rows(
    q_NHh: np.ndarray,
    k_NKh: np.ndarray,
    v_NKh: np.ndarray,
    rows: np.ndarray,
    *,
    block: int,
    masks: tuple[np.ndarray, ...] = (),
    chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Causal softmax attention of the queries `rows` only, in fp64, dense and over block masks.

    Returns (dense [R, H, h], block_mass [R, H, nb], [sparse [R, H, h] per mask]): the dense output, the
    dense softmax probability each key block holds for each row (its entries sum to 1 over the blocks), and
    for each mask [H, nb, nb] the output of the softmax taken over the keys of the selected blocks only
    (key j is seen by query i when j <= i and mask[head, i // block, j // block]). The sparse outputs come
    from the same probabilities as the dense one, renormalised over the selected keys: an independent check
    of a block-sparse kernel, with no block lists, slots or padding. `chunk` rows at a time.
    """
    n, heads, head_dim = q_NHh.shape
    group = heads // k_NKh.shape[1]
    nb = math.ceil(n / block)
    rows = np.asarray(rows)
    dense = np.empty((len(rows), heads, head_dim))
    mass = np.empty((len(rows), heads, nb))
    sparse = [np.empty((len(rows), heads, head_dim)) for _ in masks]
    key_block = np.arange(n) // block
    for h in range(heads):
        k = np.asarray(k_NKh[:, h // group], np.float64)
        v = np.asarray(v_NKh[:, h // group], np.float64)
        for start in range(0, len(rows), chunk):
            r = rows[start:start + chunk]
            s = (np.asarray(q_NHh[r, h], np.float64) / math.sqrt(head_dim)) @ k.T
            s = np.where(np.arange(n)[None, :] <= r[:, None], s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            dense[start:start + chunk, h] = p @ v
            mass[start:start + chunk, h] = _sum_pool(p, block)
            for out, mask in zip(sparse, masks, strict=True):
                selected = p * mask[h][(r // block)[:, None], key_block[None, :]]
                out[start:start + chunk, h] = (selected @ v) / selected.sum(1, keepdims=True)
    return dense, mass, sparse
