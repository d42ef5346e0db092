"""FlexPrefill: block-sparse attention for long prompts, chosen per prompt and per head (Lai et al., ICLR 2025).

A prefill of N tokens is cut into blocks of `block` queries and keys (nb = ⌈N / block⌉). For every query
head, a probe (the last `block` queries against every key) decides which key blocks each query block
computes; the attention then runs over those blocks only, with an exact softmax over them.

Selection (`select_blocks`, jit-able for a static N, as the official implementation's `get_active_blocks`):

1. The probe's causal softmax A [block, N] gives a *vertical* distribution (mean over the probe's rows, per
   key) and a *slash* one (summed along diagonals, per distance), both sum-pooled into nb blocks.
2. Budgets: how many vertical columns and slash diagonals to keep so their mass reaches γ, clamped to
   [min_budget, max_budget] (given in tokens, ⌈/block⌉ blocks).
   - `budget_rule="coverage"` (default) counts blocks: the fewest pooled blocks, the sink first, whose
     vertical mass is ≥ γ. So the probe keeps ≥ γ of its attention mass inside the selection.
   - `budget_rule="reference"` reproduces the official code: the fewest *tokens* covering γ, then
     `tokens // 128 + 1` blocks (128 even when the block is not). That count does not bound the mass:
     50 scattered heavy tokens give one block.
3. Pattern: a pooled estimate softmax(mean(q̂)·pooled(K)ᵀ) is compared with the pooled vertical by the square
   root of their Jensen–Shannon divergence. Below τ the head is *query-aware*: its vertical and slash
   budgets drop to min_budget and it adds the blocks of the block-pooled, block-causal attention
   softmax(pooled(Q)·pooled(K)ᵀ), flattened and kept while their running sum is ≤ γ·nb. τ = 0 disables it.
   Deviation: 0·log 0 counts as 0 here; the official code computes NaN there and so never picks such a head.
4. The sink column (key block 0) and the diagonal are always kept; vertical column c marks every block
   (r, c) with r ≥ c, slash offset s every block (r, r − s). Under the coverage rule a selected band of
   distances [s·block, (s+1)·block) marks block diagonals s and s + 1, the two it lies on (the official
   code marks s only, so a query early in its block loses the band's keys in the block before).

Attention: each (head, query block) item lists its selected key blocks in a fixed number of slots
(`block_lists`, diagonal first, unused slots masked); the keys and values are gathered and the softmax
taken over the listed blocks only (`sparse_attention`). `bucketed_attention` groups the items by the
power-of-two number of slots their own count needs, so the work follows the selection rather than its
densest row; one compile per (slots, group size). `flexprefill_attention` counts on the host and falls back
to `causal_attention` (dense, causal, by chunks of queries) when the prompt is short or the selection is
dense anyway.

Shapes (the dimension key of `upcycler.train.model`, except that N here is the prompt's length: its
queries and keys are the same tokens): q [N, H, h], k and v [N, K, h], after RoPE and before the h^-½
scale; query head i reads kv head i // G. n counts blocks, s slots, F items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.train.model import layers as nn

BUDGET_RULES = ("coverage", "reference")
KERNEL_CHOICES = ("auto", "sparse")
_REFERENCE_TOKENS_PER_BLOCK = 128  # the official count → blocks rule divides by 128 whatever the block size
_SCORES_BYTES = 64 << 20  # scores of the sparse kernel alive at a time


@dataclass(frozen=True)
class FlexPrefillOptions:
    """What FlexPrefill selects: coverage γ, pattern threshold τ, block size, budgets in tokens (0: none),
    the budget rule, the block density above which a layer runs dense instead, and on an accelerator
    whether the sparse kernel runs only where the cost model predicts it faster (`auto`) or whenever the
    selection is under `dense_above` (`sparse`) (`upcycle eval`'s flags:
    `evaluation.config.PrefillConfig.options`)."""

    gamma: float = 0.95
    tau: float = 0.1
    block: int = 128
    min_budget: int = 1024
    max_budget: int = 0
    budget_rule: str = "coverage"
    dense_above: float = 0.5
    kernel: str = "auto"

    def blocks(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block)

    def runs_dense(self, n_tokens: int) -> bool:
        """Prompts this short are computed densely (as the official code: ≤ max(2 blocks, min budget))."""
        return n_tokens <= max(2 * self.block, self.blocks(self.min_budget) * self.block)


class Selection(NamedTuple):
    """The key blocks each query block computes, per head: `mask_Hnn` [H, nb, nb] (only c ≤ r is ever set),
    which heads are query-aware [H], and the probe's pooled vertical distribution [H, nb]."""

    mask_Hnn: jax.Array
    query_aware_H: jax.Array
    vertical_Hn: jax.Array


class Result(NamedTuple):
    """`flexprefill_attention`'s output [N, H, h]; per head, the fraction of causal key blocks computed
    (1 for a dense run) and whether it was query-aware; whether the sparse path ran (else dense)."""

    out_NHh: jax.Array
    density_H: np.ndarray
    query_aware_H: np.ndarray
    sparse: bool


# --- selection -------------------------------------------------------------------------------------------
def select_blocks(q_NHh: jax.Array, k_NKh: jax.Array, opts: FlexPrefillOptions) -> Selection:
    """Which key blocks every query block of every head computes (see the module docstring)."""
    N, H, h = q_NHh.shape
    K = k_NKh.shape[1]
    G = H // K
    bs, nb = opts.block, opts.blocks(N)
    P = min(bs, N)
    # fp32 throughout; the keys are read once per key head (not repeated per query head) and the queries
    # only where the probe and the block means need them
    probe_PHh = q_NHh[N - P:].astype(jnp.float32) * h**-0.5
    scores_HPN = jnp.einsum("pkgd,nkd->kgpn", probe_PHh.reshape(P, K, G, h), k_NKh.astype(jnp.float32),
                            precision="highest").reshape(H, P, N)
    visible_PN = jnp.arange(N)[None, :] <= (N - P + jnp.arange(P))[:, None]
    probs_HPN = jax.nn.softmax(jnp.where(visible_PN, scores_HPN, -jnp.inf), axis=-1)
    vertical_HN = probs_HPN.mean(1)
    vertical_Hn = _sum_pool(vertical_HN, bs)
    # slash index i holds distance N − 1 − i: key j seen from probe row p lands at j + P − 1 − p (< N: the
    # probe row sees no key past itself)
    slash_HN = _shift_rows_right(probs_HPN[:, ::-1]).sum(1)[:, :N] / P if opts.budget_rule == "reference" or P < bs else None
    slash_Hn = _sum_pool(slash_HN, bs) if slash_HN is not None else _pooled_slash(probs_HPN, vertical_Hn, bs)
    lo, hi = max(1, opts.blocks(opts.min_budget)), min(opts.blocks(opts.max_budget) if opts.max_budget else nb, nb)
    if opts.budget_rule == "reference":
        n_vertical_H = _reference_count(vertical_HN, opts.gamma)
        n_slash_H = _reference_count(slash_HN, opts.gamma)
    else:
        n_vertical_H = _coverage_count(vertical_Hn, 0, opts.gamma)
        n_slash_H = _coverage_count(slash_Hn, nb - 1, opts.gamma)

    key_means_nHh = jnp.repeat(_block_means(k_NKh, bs), G, axis=1)
    estimate_Hn = jax.nn.softmax(jnp.einsum("hd,nhd->hn", probe_PHh.mean(0), key_means_nHh, precision="highest"))
    query_aware_H = _sqrt_js_divergence(estimate_Hn, vertical_Hn) < opts.tau
    n_vertical_H = jnp.where(query_aware_H, lo, jnp.clip(n_vertical_H, lo, hi))
    n_slash_H = jnp.where(query_aware_H, lo, jnp.clip(n_slash_H, lo, hi))

    columns_Hn = _top_ranks(vertical_Hn.at[:, 0].set(jnp.inf)) < n_vertical_H[:, None]
    # pooled slash block j holds offsets nb − 1 − j: reverse so index s is offset s
    offsets_Hn = (_top_ranks(slash_Hn.at[:, -1].set(jnp.inf)) < n_slash_H[:, None])[:, ::-1]
    if opts.budget_rule == "coverage":  # distances [s·block, (s+1)·block) lie on block diagonals s and s + 1
        offsets_Hn = offsets_Hn | jnp.pad(offsets_Hn[:, :-1], ((0, 0), (1, 0)))
    r, c = jnp.arange(nb)[:, None], jnp.arange(nb)[None, :]
    causal_nn = c <= r
    mask_Hnn = causal_nn & (columns_Hn[:, None, :] | offsets_Hn[:, jnp.clip(r - c, 0, nb - 1)])
    if opts.tau > 0:  # the pooled blocks (six passes over nb² entries per head) only when some head is query-aware
        pooled_Hnn = jax.lax.cond(query_aware_H.any(),
                                  lambda: _pooled_blocks(q_NHh, key_means_nHh, causal_nn, opts.gamma, bs),
                                  lambda: jnp.zeros((H, nb, nb), bool))
        mask_Hnn = mask_Hnn | (query_aware_H[:, None, None] & pooled_Hnn)
    return Selection(mask_Hnn, query_aware_H, vertical_Hn)


def _pooled_slash(probs_HPN: jax.Array, vertical_Hn: jax.Array, bs: int) -> jax.Array:
    """The slash distribution sum-pooled into blocks of `bs` [H, nb], from a probe of P = bs rows and its
    pooled vertical, without the per-distance array: probe row p moves its keys P − 1 − p places, so of
    key block c the first p + 1 keys land in pooled block c and the rest in block c + 1 (one pass over the
    probe, no shifted copies)."""
    P, N = probs_HPN.shape[1:]
    stays_PN = jnp.arange(N)[None, :] % bs <= jnp.arange(P)[:, None]
    # an elementwise product and a sum, not a matmul: it fuses with the vertical's sum over the probe rows
    stay_Hn = _sum_pool(jnp.where(stays_PN, probs_HPN, 0.0).sum(1), bs)
    move_Hn = P * vertical_Hn - stay_Hn
    return (stay_Hn + jnp.pad(move_Hn[:, :-1], ((0, 0), (1, 0)))) / P


def _shift_rows_right(x_HPN: jax.Array) -> jax.Array:
    """Row p of each [P, N] matrix moved p places right, in a [P, N + P − 1] matrix padded with zeros (a
    reshape, no scatter: rows of N + P zeros-padded entries read back with rows one entry shorter)."""
    H, P, N = x_HPN.shape
    flat = jnp.pad(x_HPN, ((0, 0), (0, 0), (0, P))).reshape(H, P * (N + P))[:, : P * (N + P - 1)]
    return flat.reshape(H, P, N + P - 1)


def _sum_pool(x_HN: jax.Array, bs: int) -> jax.Array:
    """Sums over consecutive blocks of `bs` entries, the last one padded with zeros."""
    H, N = x_HN.shape
    nb = math.ceil(N / bs)
    return jnp.pad(x_HN, ((0, 0), (0, nb * bs - N))).reshape(H, nb, bs).sum(-1)


def _block_means(x_NHh: jax.Array, bs: int) -> jax.Array:
    """Per block of `bs` positions, the mean vector [nb, H, h] in fp32 (the last block over its real
    positions)."""
    N, H, h = x_NHh.shape
    nb = math.ceil(N / bs)
    sums = jnp.pad(x_NHh, ((0, nb * bs - N), (0, 0), (0, 0))).reshape(nb, bs, H, h).sum(1, dtype=jnp.float32)
    counts = jnp.minimum(bs, N - bs * jnp.arange(nb)).astype(jnp.float32)
    return sums / counts[:, None, None]


def _reference_count(dist_HN: jax.Array, gamma: float) -> jax.Array:
    """The official budget: 1 + #sorted tokens with running sum ≤ γ, as blocks of 128 (`// 128 + 1`)."""
    running = jnp.cumsum(-jnp.sort(-dist_HN, axis=-1), axis=-1)
    tokens = (running <= gamma).sum(-1) + 1
    return tokens // _REFERENCE_TOKENS_PER_BLOCK + 1


def _coverage_count(pooled_Hn: jax.Array, forced: int, gamma: float) -> jax.Array:
    """The fewest blocks, block `forced` first then the heaviest, whose mass is ≥ γ (all of them at most)."""
    others = jnp.delete(pooled_Hn, forced, axis=1, assume_unique_indices=True)
    running = pooled_Hn[:, forced, None] + jnp.cumsum(-jnp.sort(-others, axis=-1), axis=-1)
    below = jnp.concatenate([pooled_Hn[:, forced, None] < gamma, running < gamma], axis=-1)
    return jnp.minimum(below.sum(-1) + 1, pooled_Hn.shape[1])


def _top_ranks(x_Hn: jax.Array) -> jax.Array:
    """Each entry's rank in its row, largest first (0 = largest)."""
    return jnp.argsort(jnp.argsort(-x_Hn, axis=-1, stable=True), axis=-1, stable=True)


def _sqrt_js_divergence(p_Hn: jax.Array, q_Hn: jax.Array) -> jax.Array:
    m_Hn = (p_Hn + q_Hn) / 2
    kl = lambda a, b: jnp.sum(jax.scipy.special.xlogy(a, a) - jax.scipy.special.xlogy(a, b), axis=-1)
    return jnp.sqrt(jnp.maximum(0.5 * kl(p_Hn, m_Hn) + 0.5 * kl(q_Hn, m_Hn), 0.0))


def _pooled_blocks(q_NHh, key_means_nHh, causal_nn, gamma: float, bs: int) -> jax.Array:
    """Query-aware blocks [H, nb, nb]: the block-causal softmax of pooled queries against pooled keys,
    flattened per head, the heaviest kept while the running sum is ≤ γ·nb."""
    h = q_NHh.shape[-1]
    nb = causal_nn.shape[0]
    query_means_nHh = _block_means(q_NHh, bs)
    logits_Hnn = jnp.einsum("rhd,chd->hrc", query_means_nHh * h**-0.5, key_means_nHh, precision="highest")
    probs_HF = jax.nn.softmax(jnp.where(causal_nn, logits_Hnn, -jnp.inf), axis=-1).reshape(-1, nb * nb)
    return _heaviest_within(probs_HF, gamma * nb).reshape(-1, nb, nb) & causal_nn


_SEARCH_BITS = 5  # bits of the threshold found per pass over the row (2⁵ + 1 candidate thresholds at once)


def _heaviest_within(x_HF: jax.Array, budget: float) -> jax.Array:
    """Which entries of each row of probabilities (≥ 0, ≤ 1) a descending stable sort keeps while its running
    sum is ≤ `budget`: the largest first, equal values in index order.

    Found without sorting the row (nb² entries per head): non-negative floats order as their int32 bit
    patterns, so a search over bit patterns finds the least threshold t whose mass above it,
    f(t) = Σ{x ≥ t}, is ≤ budget — every entry ≥ t is kept, and of the entries equal to the largest value
    below t as many as still fit, in index order. Each pass reads the row once and evaluates f at 33
    thresholds, narrowing t by 5 of its 30 bits (values ≤ 1.0 are < 2³⁰ as bits): six passes."""
    bits_HF = jax.lax.bitcast_convert_type(x_HF.astype(jnp.float32), jnp.int32)
    x_HF = x_HF.astype(jnp.float32)
    candidates = 1 << _SEARCH_BITS

    def mass_at_or_above(t_HT: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(bits_HF[:, :, None] >= t_HT[:, None, :], x_HF[:, :, None], 0.0), axis=1)

    def narrow(width_log2: int, lo_H: jax.Array) -> tuple[jax.Array, jax.Array]:
        # invariant: f(lo) > budget or lo = 0, and f(lo + 2^width_log2) ≤ budget
        step = 1 << (width_log2 - _SEARCH_BITS)
        t_HT = lo_H[:, None] + step * jnp.arange(candidates + 1, dtype=jnp.int32)
        first_within_H = jnp.argmax(mass_at_or_above(t_HT) <= budget, axis=1)
        return jnp.take_along_axis(t_HT, jnp.maximum(first_within_H - 1, 0)[:, None], axis=1)[:, 0], first_within_H

    lo_H = jnp.zeros(x_HF.shape[0], jnp.int32)
    width_log2 = 30
    while width_log2 > 0:
        lo_H, first_within_H = narrow(width_log2, lo_H)
        width_log2 -= _SEARCH_BITS
    # the last pass had step 1: the threshold is lo + 1, or lo itself where f(lo) ≤ budget already (only lo = 0)
    t_H = jnp.where(first_within_H == 0, lo_H, lo_H + 1)
    above_HF = bits_HF >= t_H[:, None]
    spare_H = budget - jnp.sum(jnp.where(above_HF, x_HF, 0.0), axis=1)
    tie_bits_H = jnp.max(jnp.where(above_HF, -1, bits_HF), axis=1)  # the largest value below t (−1: none)
    tie_HF = bits_HF == tie_bits_H[:, None]
    tie_value_H = jax.lax.bitcast_convert_type(jnp.maximum(tie_bits_H, 0), jnp.float32)
    fits_H = jnp.where(tie_value_H > 0, jnp.floor(spare_H / jnp.where(tie_value_H > 0, tie_value_H, 1.0)),
                       jnp.inf)  # zeros add nothing: all of them fit
    return above_HF | (tie_HF & (jnp.cumsum(tie_HF, axis=1) <= fits_H[:, None]))


# --- attention over the selected blocks ------------------------------------------------------------------
def block_lists(mask_Hnn: jax.Array, bucket: int, rows_Hn: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Each query block's selected key blocks in `bucket` slots, the diagonal first: (ids [H, n, bucket],
    valid [H, n, bucket]). `bucket` must hold the largest count; unused slots are marked invalid. `rows_Hn`
    names the query block of each mask row when the rows are a subset (default: row i is block i)."""
    n, nb = mask_Hnn.shape[-2:]
    rows_Hn = jnp.arange(n)[None, :] if rows_Hn is None else rows_Hn
    diagonal_Hnn = rows_Hn[..., None] == jnp.arange(nb)
    priority_Hnn = mask_Hnn.astype(jnp.int32) * 2 + diagonal_Hnn.astype(jnp.int32) * 4
    priority_Hnb, ids_Hnb = jax.lax.top_k(priority_Hnn, bucket)
    return ids_Hnb.astype(jnp.int32), priority_Hnb > 0


def sparse_attention(q_NHh, k_NKh, v_NKh, ids_Hnb, valid_Hnb, block: int) -> jax.Array:
    """Causal softmax attention of every query block over its listed key blocks only: [N, H, h].

    With every block c ≤ r listed it equals dense causal attention. Scores and softmax in fp32.
    """
    N, H, h = q_NHh.shape
    nb, bucket = ids_Hnb.shape[1], ids_Hnb.shape[2]
    heads, rows = jnp.meshgrid(jnp.arange(H), jnp.arange(nb), indexing="ij")
    out_Fbh = _attend_items(q_NHh, k_NKh, v_NKh, heads.ravel(), rows.ravel(), ids_Hnb.reshape(H * nb, bucket),
                            valid_Hnb.reshape(H * nb, bucket), block)
    out_Hnbh = out_Fbh.reshape(H, nb * block, h)[:, :N]
    return jnp.moveaxis(out_Hnbh, 0, 1).astype(q_NHh.dtype)


def _attend_items(q_NHh, k_NKh, v_NKh, heads_F, rows_F, ids_Fs, valid_Fs, block: int) -> jax.Array:
    """The attention output [F, block, h] of F (head, query block) items, each over its listed key blocks
    (`ids_Fs`, `valid_Fs`: s slots), one batch of items at a time."""
    N, H, h = q_NHh.shape
    G, nb, slots = H // k_NKh.shape[1], math.ceil(N / block), ids_Fs.shape[1]
    pad = nb * block - N
    blocks = lambda x: jnp.pad(x, ((0, pad), (0, 0), (0, 0))).reshape(nb, block, x.shape[1], h)
    q_Hnbh = jnp.moveaxis(blocks(q_NHh), 2, 0)
    k_Knbh, v_Knbh = jnp.moveaxis(blocks(k_NKh), 2, 0), jnp.moveaxis(blocks(v_NKh), 2, 0)
    inside_bb = jnp.arange(block)[None, :] <= jnp.arange(block)[:, None]  # key ≤ query within a block

    def one_item(args):
        head, row, ids_s, valid_s = args
        q_bh, k_sbh, v_sbh = q_Hnbh[head, row], k_Knbh[head // G, ids_s], v_Knbh[head // G, ids_s]
        scores_bsb = jnp.einsum("qd,skd->qsk", q_bh, k_sbh, preferred_element_type=jnp.float32) * h**-0.5
        visible_bsb = valid_s[None, :, None] & ((ids_s < row)[None, :, None] | (ids_s == row)[None, :, None]
                                                & inside_bb[:, None, :])
        scores_bsb = jnp.where(visible_bsb, scores_bsb, nn.MASKED)
        probs_bF = jax.nn.softmax(scores_bsb.reshape(block, slots * block), axis=-1)
        return jnp.einsum("qf,fd->qd", probs_bF.astype(v_sbh.dtype), v_sbh.reshape(slots * block, h))

    batch = max(1, min(len(heads_F), _SCORES_BYTES // (4 * block * block * slots)))
    return jax.lax.map(one_item, (heads_F, rows_F, ids_Fs, valid_Fs), batch_size=batch)


@partial(jax.jit, static_argnames=("slots", "block"))
def _attend_bucket(q_NHh, k_NKh, v_NKh, mask_Hnn, items_F, *, slots: int, block: int) -> jax.Array:
    """`_attend_items` for the (head, query block) items `items_F` (flat indices head·nb + row), each with
    its selected key blocks in `slots` slots, the diagonal first."""
    H, nb, _ = mask_Hnn.shape
    heads_F, rows_F = items_F // nb, items_F % nb
    ids_Fs, valid_Fs = block_lists(mask_Hnn.reshape(H * nb, nb)[items_F][:, None], slots, rows_F[:, None])
    return _attend_items(q_NHh, k_NKh, v_NKh, heads_F, rows_F, ids_Fs[:, 0], valid_Fs[:, 0], block)


def bucketed_attention(q_NHh, k_NKh, v_NKh, mask_Hnn, counts_Hn: np.ndarray, block: int) -> jax.Array:
    """`sparse_attention` of a selection, with every (head, query block) item computed in the power-of-two
    number of slots that holds its own count: items are grouped by slots (and each group padded to a
    power-of-two number of items), so the work follows the selected blocks rather than the largest row.
    One compile per (slots, group size)."""
    N, H, h = q_NHh.shape
    nb = counts_Hn.shape[1]
    # a power of two, but never more slots than there are key blocks (nb need not be a power of two)
    slots_F = np.minimum(nb, 1 << np.ceil(np.log2(np.maximum(counts_Hn.ravel(), 1))).astype(np.int64))
    outs, order = [], []
    for slots in np.unique(slots_F):
        items = np.flatnonzero(slots_F == slots)
        padded = np.resize(items, 1 << int(len(items) - 1).bit_length())  # repeats of its own items, dropped below
        outs.append(_attend_bucket(q_NHh, k_NKh, v_NKh, mask_Hnn, jnp.asarray(padded, jnp.int32),
                                   slots=int(slots), block=block)[: len(items)])
        order.append(items)
    out_Fbh = jnp.concatenate(outs)[np.argsort(np.concatenate(order))]
    return jnp.moveaxis(out_Fbh.reshape(H, nb * block, h)[:, :N], 0, 1).astype(q_NHh.dtype)


def causal_attention(q_NHh, k_NKh, v_NKh, *, chunk: int = 256, window: int = 0, bands: int = 8) -> jax.Array:
    """Dense causal attention [N, H, h] (the model's einsum attention: scores and softmax in fp32, scaled by
    h^-½) by chunks of `chunk` queries, one chunk at a time. The chunks are grouped into `bands` bands, and
    a band's chunks read the keys up to the band's last query: 9/16 of the square's work for 8 bands, where
    causal attention needs 1/2. `window` > 0 limits every query to the `window` keys before it
    (sliding-window layers). Inside, heads lead ([K, G·chunk, h] queries against [K, S, h] keys, as the
    sparse path lays them out): one batched matmul per kv head, twice as fast on CPU as the [B, L, H, h]
    layout of `layers.attention` for the same sums."""
    N, H, h = q_NHh.shape
    K = k_NKh.shape[1]
    G = H // K
    n = math.ceil(N / chunk)
    q_padded = jnp.pad(q_NHh, ((0, n * chunk - N), (0, 0), (0, 0)))
    q_nKmh = q_padded.reshape(n, chunk, K, G, h).transpose(0, 2, 3, 1, 4).reshape(n, K, G * chunk, h)
    k_KSh, v_KSh = jnp.moveaxis(k_NKh, 1, 0), jnp.moveaxis(v_NKh, 1, 0)
    per_band = math.ceil(n / min(bands, n))
    outs = []
    for first in range(0, n, per_band):
        last = min(n, first + per_band)
        key_end = min(N, last * chunk)
        key_start = max(0, first * chunk - window + 1) if window > 0 else 0
        k_band, v_band = k_KSh[:, key_start:key_end], v_KSh[:, key_start:key_end]
        cols = jnp.arange(key_start, key_end)[None, :]

        def one_chunk(args, k_band=k_band, v_band=v_band, cols=cols):
            q_Kmh, start = args
            rows = start + jnp.arange(chunk)[:, None]
            visible_cS = (cols <= rows) & ((rows - cols < window) if window > 0 else True)
            scores = jnp.einsum("kmh,ksh->kms", q_Kmh, k_band, preferred_element_type=jnp.float32)
            scores_KGcS = scores.reshape(K, G, chunk, -1)
            scores_KGcS = jnp.where(visible_cS[None, None], scores_KGcS * (h**-0.5), nn.MASKED)
            probs = jax.nn.softmax(scores_KGcS, axis=-1).astype(v_band.dtype).reshape(K, G * chunk, -1)
            return jnp.einsum("kms,ksh->kmh", probs, v_band)

        outs.append(jax.lax.map(one_chunk, (q_nKmh[first:last], jnp.arange(first, last) * chunk)))
    out_nKGch = jnp.concatenate(outs).reshape(n, K, G, chunk, h)
    return out_nKGch.transpose(0, 3, 1, 2, 4).reshape(n * chunk, H, h)[:N]


select_blocks_jit = jax.jit(select_blocks, static_argnames="opts")
causal_attention_jit = jax.jit(causal_attention, static_argnames=("chunk", "window", "bands"))


def flexprefill_attention(q_NHh, k_NKh, v_NKh, opts: FlexPrefillOptions) -> Result:
    """FlexPrefill attention of one prompt: select, choose the bucket on the host, attend sparsely; dense
    (`causal_attention`) for short prompts and when the selection's density exceeds `opts.dense_above`."""
    N, H, _ = q_NHh.shape
    dense = lambda: Result(causal_attention_jit(q_NHh, k_NKh, v_NKh), np.ones(H), np.zeros(H, bool), False)
    if opts.runs_dense(N):
        return dense()
    selection = select_blocks_jit(q_NHh, k_NKh, opts)
    counts_Hn = np.asarray(selection.mask_Hnn.sum(-1))
    nb = counts_Hn.shape[1]
    density_H = counts_Hn.sum(-1) / (nb * (nb + 1) / 2)
    if density_H.mean() > opts.dense_above:
        return dense()
    out = bucketed_attention(q_NHh, k_NKh, v_NKh, selection.mask_Hnn, counts_Hn, opts.block)
    return Result(out, density_H, np.asarray(selection.query_aware_H), True)
