"""FlexPrefill (`upcycler.train.model.flexprefill`): the official selection, its invariants, exact attention.

Expected values come from numpy in fp64: `flexprefill_reference` (a port of the official `get_active_blocks`)
for parity, and direct probe, softmax and attention computations for the rest. The JAX code runs in fp32
with the highest matmul precision.

- Parity (`budget_rule="reference"`): the mask equals the port's within the causal triangle c ≤ r (the
  official code can list blocks above it only for query-aware heads at γ = 1, which these cases avoid), and
  the query-aware heads are the same. τ is put in the widest gap between the heads' distances, so both kinds
  of head occur and fp32 against fp64 rounding cannot move a head across it.
- Invariants (`budget_rule="coverage"`): the probe keeps ≥ γ of its attention inside the selection; the
  columns and diagonals the coverage rule must take are all taken; query-aware heads hold their pooled
  blocks; nothing above the diagonal.
- Exactness: with everything selected, with padding slots, and on the dense paths, the output equals
  dense causal softmax attention.

Inputs: random q, k give diffuse attention (a large selection), so most cases add structure: a few heavy key
columns that every query of some heads attends (a vertical pattern, the sink among them) and queries and keys
sharing a positional code so that some heads attend nearby keys (a slash pattern).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flexprefill_reference import reference_block_mask, reference_selection

from upcycler.train.model import flexprefill as fp

NO_LIMIT = 1 << 30  # a block budget no prompt here reaches
F32_EXACT = {"rtol": 0.0, "atol": 1e-6}
# structured inputs have logits up to ~20, so fp32 rounding of the scores alone moves outputs by a few 1e-6
# (the dense path as much as the sparse one)
F32_LARGE_LOGITS = {"rtol": 0.0, "atol": 2e-5}


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


# --- inputs ----------------------------------------------------------------------------------------------
def random_qkv(seed: int, n: int, heads: int, kv_heads: int, head_dim: int = 32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, heads, head_dim))
    k = rng.normal(size=(n, kv_heads, head_dim))
    v = rng.normal(size=(n, kv_heads, head_dim))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def structured_qk(seed: int, n: int, heads: int, kv_heads: int, *, local, sink, head_dim: int = 32):
    """q [n, heads, h], k [n, kv_heads, h] with attention patterns: query head i adds `local[i]` times a
    positional code shared with the keys (it attends nearby keys: slash) and `sink[i]` times a direction in
    which key 0 and four other keys are heavy (it attends those columns: vertical)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)[:, None]
    freqs = np.geomspace(0.5, 0.002, head_dim // 2)
    code = np.concatenate([np.cos(t * freqs), np.sin(t * freqs)], 1) / np.sqrt(head_dim / 2)  # unit rows
    u = rng.normal(size=head_dim)
    u /= np.linalg.norm(u)
    q = rng.normal(size=(n, heads, head_dim))
    k = rng.normal(size=(n, kv_heads, head_dim)) + 0.5 * np.sqrt(head_dim) * code[:, None]
    heavy = np.concatenate([[0], rng.choice(np.arange(1, n), 4, replace=False)])
    k[heavy] += 4.0 * u
    for i in range(heads):
        q[:, i] += np.sqrt(head_dim) * (local[i] * code + sink[i] * u)
    return q.astype(np.float32), k.astype(np.float32)


LOCAL_SINK = {  # per query head (4 heads): local (slash) and sink (vertical) strengths
    "mild": ([0.0, 1.0, 2.0, 0.5], [0.0, 0.5, 0.2, 1.0]),
    "strong": ([3.0, 0.0, 1.5, 0.0], [0.0, 3.0, 1.0, 1.5]),
}


def split_tau(distance_H: np.ndarray) -> float:
    """A τ in the widest gap between the heads' distances, so both kinds of head occur."""
    d = np.sort(distance_H[np.isfinite(distance_H)])
    gaps = np.diff(d)
    i = int(np.argmax(gaps))
    assert gaps[i] > 1e-4, f"the distances {d} leave no safe place for τ"
    return float((d[i] + d[i + 1]) / 2)


# --- numpy references ------------------------------------------------------------------------------------
def blocks_of(n: int, block: int) -> int:
    return math.ceil(n / block)


def causal_blocks(nb: int) -> np.ndarray:
    return np.tril(np.ones((nb, nb), bool))


def np_attention(q, k, v, mask_Hnn=None, block: int = 1, window: int = 0) -> np.ndarray:
    """Causal softmax attention in fp64 [n, H, h]; with a block mask, only keys whose block (row's block,
    key's block) is selected are seen; with a window, only the `window` keys up to the query."""
    n, heads, head_dim = q.shape
    group = heads // k.shape[1]
    distance = np.arange(n)[:, None] - np.arange(n)[None, :]
    visible = (distance >= 0) & ((distance < window) if window > 0 else True)
    out = np.empty((n, heads, head_dim))
    for i in range(heads):
        seen = visible
        if mask_Hnn is not None:
            blk = np.arange(n) // block
            seen = visible & mask_Hnn[i][blk[:, None], blk[None, :]]
        s = q[:, i].astype(np.float64) @ k[:, i // group].astype(np.float64).T / np.sqrt(head_dim)
        s = np.where(seen, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, i] = (p / p.sum(1, keepdims=True)) @ v[:, i // group].astype(np.float64)
    return out


def probe_mass(q, k, mask_Hnn, block: int) -> np.ndarray:
    """Per head, the mean over the last `block` queries of their causal softmax mass on keys whose block is
    selected in the query's block row (fp64)."""
    n, heads, head_dim = q.shape
    group = heads // k.shape[1]
    rows = np.arange(n - block, n)
    mass = np.empty(heads)
    for i in range(heads):
        s = q[rows, i].astype(np.float64) @ k[:, i // group].astype(np.float64).T / np.sqrt(head_dim)
        s[np.arange(n)[None, :] > rows[:, None]] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        selected = mask_Hnn[i][(rows // block)[:, None], (np.arange(n) // block)[None, :]]
        mass[i] = (p * selected).sum(1).mean()
    return mass


def must_cover(pooled_n: np.ndarray, forced: int, gamma: float) -> np.ndarray:
    """The blocks the coverage rule cannot leave out: block `forced`, then the heaviest others, until their
    mass reaches γ − 1e-6 (the slack absorbs fp32 against fp64 rounding)."""
    others = [j for j in np.argsort(-pooled_n, kind="stable") if j != forced]
    taken, mass = [forced], pooled_n[forced]
    for j in others:
        if mass >= gamma - 1e-6:
            break
        taken.append(j)
        mass += pooled_n[j]
    return np.array(taken)


def pooled_must_keep(q, k, head: int, block: int, gamma: float) -> np.ndarray:
    """Query-aware head: the blocks (r, c) of the block-pooled, block-causal attention that the γ·nb prefix
    keeps with room to spare (running sum ≤ γ·nb − 1e-4), as a bool [nb, nb]."""
    n, heads, head_dim = q.shape
    group = heads // k.shape[1]
    nb = blocks_of(n, block)
    qm = np.stack([q[b * block:(b + 1) * block, head].astype(np.float64).mean(0) for b in range(nb)])
    km = np.stack([k[b * block:(b + 1) * block, head // group].astype(np.float64).mean(0) for b in range(nb)])
    s = np.where(causal_blocks(nb), qm @ km.T / np.sqrt(head_dim), -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    p = (p / p.sum(1, keepdims=True)).ravel()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(nb * nb, bool)
    keep[order[np.cumsum(p[order]) <= gamma * nb - 1e-4]] = True
    return keep.reshape(nb, nb)


_select = jax.jit(fp.select_blocks, static_argnames="opts")


def select(q, k, opts: fp.FlexPrefillOptions) -> fp.Selection:
    sel = _select(jnp.asarray(q), jnp.asarray(k), opts)
    return fp.Selection(*(np.asarray(x) for x in sel))


def options(block: int, **kw) -> fp.FlexPrefillOptions:
    """Options with budgets given in blocks (`min_blocks`, `max_blocks`; 0: no limit)."""
    kw["min_budget"] = kw.pop("min_blocks", 1) * block
    kw["max_budget"] = kw.pop("max_blocks", 0) * block
    return fp.FlexPrefillOptions(block=block, **kw)


# --- 1. parity with the official selection ---------------------------------------------------------------
# (name, seed, n, block, heads, kv_heads, inputs, γ, min blocks, max blocks; 0 = none)
PARITY_CASES = [
    ("gqa_aligned_clamped", 0, 2048, 64, 4, 2, "mild", 0.9, 2, 9),
    ("gqa_aligned", 1, 2048, 64, 4, 2, "mild", 0.95, 1, 0),
    ("mha_unaligned_clamped", 2, 1000, 64, 4, 4, "mild", 0.9, 2, 5),
    ("gqa_unaligned_block128", 3, 1500, 128, 4, 2, "mild", 0.8, 3, 0),
    ("mha_unaligned_block128_clamped", 2, 640, 128, 4, 4, "mild", 0.95, 1, 4),
    ("gqa_strong_clamped", 4, 1000, 64, 4, 2, "strong", 0.9, 1, 4),
    ("gqa_random", 5, 1000, 64, 4, 2, "random", 0.9, 2, 0),
    ("mha_random_aligned", 6, 2048, 128, 4, 4, "random", 0.9, 1, 0),
    ("gqa_min_budget_zero", 0, 1000, 64, 4, 2, "strong", 0.9, 0, 0),
]


def parity_inputs(seed, n, heads, kv_heads, kind):
    if kind == "random":
        q, k, _ = random_qkv(seed, n, heads, kv_heads)
        return q, k
    local, sink = LOCAL_SINK[kind]
    return structured_qk(seed, n, heads, kv_heads, local=local, sink=sink)


@pytest.mark.parametrize("case", PARITY_CASES, ids=[c[0] for c in PARITY_CASES])
def test_reference_rule_matches_official_selection(case) -> None:
    _, seed, n, block, heads, kv_heads, kind, gamma, min_blocks, max_blocks = case
    q, k = parity_inputs(seed, n, heads, kv_heads, kind)
    budgets = {"min_budget_blocks": min_blocks, "max_budget_blocks": max_blocks or NO_LIMIT}
    tau = split_tau(reference_selection(q, k, block=block, gamma=gamma, tau=0.0, **budgets).distance_H)
    want = reference_selection(q, k, block=block, gamma=gamma, tau=tau, **budgets)
    assert want.query_aware_H.any() and not want.query_aware_H.all()
    # the vertical-slash heads' counts before the upper clamp: some inside the clamps, some above the upper
    free = reference_selection(q, k, block=block, gamma=gamma, tau=tau, min_budget_blocks=min_blocks,
                               max_budget_blocks=NO_LIMIT)
    counts = np.concatenate([free.vertical_count_H, free.slash_count_H])[np.tile(~want.query_aware_H, 2)]
    upper = min(max_blocks or NO_LIMIT, blocks_of(n, block))
    assert ((counts > min_blocks) & (counts < upper)).any(), "no budget falls strictly inside the clamps"
    if max_blocks:
        assert (counts > max_blocks).any(), "the upper clamp is never used"

    got = select(q, k, options(block, gamma=gamma, tau=tau, min_blocks=min_blocks, max_blocks=max_blocks,
                               budget_rule="reference"))
    causal = causal_blocks(blocks_of(n, block))
    np.testing.assert_array_equal(got.query_aware_H, want.query_aware_H)
    for h in range(heads):
        np.testing.assert_array_equal(got.mask_Hnn[h] & causal, want.mask_Hnn[h] & causal, err_msg=f"head {h}")
    np.testing.assert_allclose(got.vertical_Hn, want.vertical_Hn, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.vertical_Hn.sum(-1), 1.0, rtol=0, atol=1e-5)


def test_reference_rule_without_query_aware_heads() -> None:
    q, k = parity_inputs(7, 700, 4, 2, "strong")
    want, qaware = reference_block_mask(q, k, block=64, gamma=0.9, tau=0.0, min_budget_blocks=1,
                                        max_budget_blocks=NO_LIMIT)
    got = select(q, k, options(64, gamma=0.9, tau=0.0, min_blocks=1, budget_rule="reference"))
    assert not qaware.any() and not got.query_aware_H.any()
    np.testing.assert_array_equal(got.mask_Hnn & causal_blocks(11), want & causal_blocks(11))


def test_reference_port_reproduces_the_128_token_rule() -> None:
    """The official count is tokens // 128 + 1 whatever the block: at block 64 a head that needs ~900 tokens
    gets 8 blocks (512 tokens), not the 15 blocks those tokens span."""
    q, k, _ = random_qkv(8, 1024, 2, 2)
    sel = reference_selection(q, k, block=64, gamma=0.9, tau=0.0, min_budget_blocks=1, max_budget_blocks=NO_LIMIT)
    n = 1024
    for h in range(2):
        s = q[-64:, h].astype(np.float64) @ k[:, h].astype(np.float64).T / np.sqrt(32)
        s[np.arange(n)[None, :] > (n - 64 + np.arange(64))[:, None]] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        vertical = (p / p.sum(1, keepdims=True)).mean(0)
        tokens = int(np.sum(np.cumsum(np.sort(vertical)[::-1]) <= 0.9)) + 1
        assert tokens > 300
        assert sel.vertical_count_H[h] == tokens // 128 + 1 < math.ceil(tokens / 64)


# --- 2. invariants of the coverage rule ------------------------------------------------------------------
# (seed, n, block, heads, kv_heads, inputs, γ)
COVERAGE_CASES = [
    (0, 2048, 64, 4, 2, "strong", 0.9),
    (1, 1000, 64, 4, 4, "strong", 0.8),
    (2, 3000, 128, 4, 2, "strong", 0.9),
]


def check_always_kept(mask_Hnn: np.ndarray) -> None:
    nb = mask_Hnn.shape[-1]
    assert mask_Hnn[:, :, 0].all(), "the sink column is not always selected"
    assert mask_Hnn[:, np.arange(nb), np.arange(nb)].all(), "the diagonal is not always selected"
    assert not (mask_Hnn & ~causal_blocks(nb)).any(), "a block above the diagonal is selected"


def check_coverage_head(mask_nn, vertical_n, slash_n, gamma) -> None:
    """The columns (sink first) and diagonals (main first) the coverage rule must take are whole; a band of
    token distances [s·block, (s+1)·block) lies on block diagonals s and s + 1, so both are taken."""
    nb = mask_nn.shape[0]
    for c in must_cover(vertical_n, 0, gamma):
        assert mask_nn[c:, c].all(), f"column {c} is needed for γ but not selected"
    for s in must_cover(slash_n, nb - 1, gamma):
        for offset in {nb - 1 - s, min(nb - s, nb - 1)}:
            assert mask_nn[np.arange(offset, nb), np.arange(nb - offset)].all(), f"diagonal {offset} not selected"


@pytest.mark.parametrize("case", COVERAGE_CASES, ids=["gqa_aligned", "mha_unaligned", "gqa_block128"])
def test_coverage_rule_keeps_gamma_of_the_probe(case) -> None:
    seed, n, block, heads, kv_heads, kind, gamma = case
    q, k = parity_inputs(seed, n, heads, kv_heads, kind)
    got = select(q, k, options(block, gamma=gamma, tau=0.0))
    ref = reference_selection(q, k, block=block, gamma=gamma, tau=0.0, min_budget_blocks=1,
                              max_budget_blocks=NO_LIMIT)
    nb = blocks_of(n, block)
    assert not got.query_aware_H.any()
    check_always_kept(got.mask_Hnn)
    assert (probe_mass(q, k, got.mask_Hnn, block) >= gamma - 1e-6).all()
    for h in range(heads):
        check_coverage_head(got.mask_Hnn[h], ref.vertical_Hn[h], ref.slash_Hn[h], gamma)
    density = got.mask_Hnn.sum((1, 2)) / causal_blocks(nb).sum()
    assert density.min() < 0.6, f"every head is nearly dense ({density}); the check says little"


def test_query_aware_heads_keep_their_pooled_blocks() -> None:
    q, k = parity_inputs(0, 2048, 4, 2, "mild")
    gamma, block, min_blocks = 0.9, 64, 2
    ref = reference_selection(q, k, block=block, gamma=gamma, tau=0.0, min_budget_blocks=min_blocks,
                              max_budget_blocks=NO_LIMIT)
    tau = split_tau(ref.distance_H)
    got = select(q, k, options(block, gamma=gamma, tau=tau, min_blocks=min_blocks))
    np.testing.assert_array_equal(got.query_aware_H, ref.distance_H < tau)
    assert got.query_aware_H.any() and not got.query_aware_H.all()
    check_always_kept(got.mask_Hnn)
    nb = blocks_of(2048, block)
    mass = probe_mass(q, k, got.mask_Hnn, block)
    for h in range(4):
        if got.query_aware_H[h]:
            # min_budget columns and diagonals: the sink and the heaviest other column, the main diagonal and
            # the heaviest other; and the pooled attention's prefix
            top_column = np.argsort(-ref.vertical_Hn[h, 1:])[0] + 1
            assert got.mask_Hnn[h, top_column:, top_column].all()
            top_offset = nb - 1 - (np.argsort(-ref.slash_Hn[h, :-1])[0])
            assert got.mask_Hnn[h, np.arange(top_offset, nb), np.arange(nb - top_offset)].all()
            keep = pooled_must_keep(q, k, h, block, gamma)
            assert keep.sum() > nb
            assert got.mask_Hnn[h][keep].all(), f"head {h} misses blocks of its pooled attention"
        else:
            check_coverage_head(got.mask_Hnn[h], ref.vertical_Hn[h], ref.slash_Hn[h], gamma)
            assert mass[h] >= gamma - 1e-6


def test_query_aware_heads_keep_sink_and_diagonal_at_zero_min_budget() -> None:
    """min_budget = 0 gives query-aware heads no vertical or slash blocks of their own; the official code still
    lists the sink column and the diagonal for them (its top-k lists are padded with column 0 and offset 0
    up to the largest count, which a vertical-slash head makes ≥ 1)."""
    q, k = parity_inputs(0, 1000, 4, 2, "strong")
    ref = reference_selection(q, k, block=64, gamma=0.9, tau=0.0, min_budget_blocks=0, max_budget_blocks=NO_LIMIT)
    tau = split_tau(ref.distance_H)
    got = select(q, k, options(64, gamma=0.9, tau=tau, min_blocks=0))
    assert got.query_aware_H.any() and not got.query_aware_H.all()
    check_always_kept(got.mask_Hnn)


def test_gamma_one_query_aware_heads_stay_causal() -> None:
    """At γ = 1 every block of a query-aware head's pooled attention is kept (the official code can then
    list blocks above the diagonal too); ours keeps the causal triangle only."""
    q, k = parity_inputs(1, 1000, 4, 2, "mild")
    got = select(q, k, options(64, gamma=1.0, tau=10.0))
    assert got.query_aware_H.all()
    check_always_kept(got.mask_Hnn)


def test_max_budget_bounds_the_coverage_selection() -> None:
    """With max_budget m blocks, each row holds at most m columns and the block diagonals of m distance
    bands (two each): ≤ 3m blocks."""
    q, k, _ = random_qkv(9, 640, 4, 2)
    got = select(q, k, options(64, gamma=0.95, tau=0.0, max_blocks=3))
    check_always_kept(got.mask_Hnn)
    assert got.mask_Hnn.sum(-1).max() <= 9


# --- 3. exact attention ----------------------------------------------------------------------------------
def test_full_selection_through_the_sparse_path_equals_dense(monkeypatch) -> None:
    """γ = 1, τ = 0 selects every causal block; `dense_above` = 1 keeps the sparse path (dense would raise)."""
    q, k, v = random_qkv(10, 1000, 4, 2)

    def no_dense(*args, **kwargs):
        raise AssertionError("the dense path ran")

    monkeypatch.setattr(fp, "causal_attention_jit", no_dense)
    out, density, qaware, sparse = fp.flexprefill_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                            options(64, gamma=1.0, tau=0.0, dense_above=1.0))
    np.testing.assert_array_equal(density, 1.0)
    assert not qaware.any() and sparse
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v), **F32_EXACT)


def test_min_budget_over_the_prompt_runs_dense() -> None:
    q, k, v = random_qkv(11, 700, 4, 2)
    out, density, qaware, sparse = fp.flexprefill_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                            fp.FlexPrefillOptions(gamma=1.0, tau=0.0, block=64,
                                                                                  min_budget=700))
    np.testing.assert_array_equal(density, 1.0)
    assert not qaware.any() and not sparse
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v), **F32_EXACT)


@pytest.mark.parametrize("n", [1024, 1000])
def test_sparse_attention_with_every_causal_block_equals_dense(n: int) -> None:
    q, k, v = random_qkv(12, n, 4, 2)
    nb = blocks_of(n, 64)
    mask = jnp.broadcast_to(jnp.asarray(causal_blocks(nb)), (4, nb, nb))
    ids, valid = fp.block_lists(mask, nb)
    out = fp.sparse_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ids, valid, 64)
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v), **F32_EXACT)


def random_block_mask(seed: int, heads: int, nb: int, p: float) -> np.ndarray:
    """A causal block mask with the sink column, the diagonal and a fraction p of the other blocks."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((heads, nb, nb)) < p) & causal_blocks(nb)
    mask[:, :, 0] = True
    mask[:, np.arange(nb), np.arange(nb)] = True
    return mask


def test_padding_slots_change_nothing() -> None:
    n, block = 1000, 64
    q, k, v = random_qkv(13, n, 4, 2)
    nb = blocks_of(n, block)
    mask = random_block_mask(13, 4, nb, 0.15)
    tight = 1 << int(mask.sum(-1).max() - 1).bit_length()
    assert tight <= nb // 2
    outs = []
    for bucket in (tight, nb):
        ids, valid = fp.block_lists(jnp.asarray(mask), bucket)
        outs.append(np.asarray(fp.sparse_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ids, valid,
                                                   block)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(outs[0], np_attention(q, k, v, mask, block), **F32_EXACT)


CAUSAL_CASES = {  # name: (n, heads, kv_heads, causal_attention keywords)
    "gqa_default_chunks": (1000, 4, 2, {}),
    "mha_uneven_bands": (600, 2, 2, {"chunk": 64, "bands": 3}),
    "sliding_window": (600, 4, 2, {"chunk": 64, "bands": 3, "window": 100}),
}


@pytest.mark.parametrize("name", CAUSAL_CASES)
def test_causal_attention_equals_dense(name: str) -> None:
    n, heads, kv_heads, kw = CAUSAL_CASES[name]
    q, k, v = random_qkv(14, n, heads, kv_heads)
    out = fp.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **kw)
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v, window=kw.get("window", 0)), **F32_EXACT)


def test_short_prompts_run_dense() -> None:
    """Dense when N ≤ max(2·block, ⌈min_budget / block⌉·block), as the official code."""
    for block, min_budget in [(64, 1), (64, 300), (128, 1024), (128, 0)]:
        limit = max(2 * block, math.ceil(min_budget / block) * block)
        opts = fp.FlexPrefillOptions(block=block, min_budget=min_budget)
        assert [opts.runs_dense(n) for n in (limit - 1, limit, limit + 1)] == [True, True, False]
    q, k, v = random_qkv(15, 128, 2, 1)
    out, density, qaware, sparse = fp.flexprefill_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                            options(64, gamma=0.5))
    np.testing.assert_array_equal(density, 1.0)
    assert not qaware.any() and not sparse
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v), **F32_EXACT)


# --- 4. the whole op -------------------------------------------------------------------------------------
def test_sparse_op_matches_official_selection_and_block_sparse_softmax() -> None:
    """The reference rule end to end: density per head and output follow the official mask."""
    n, block, gamma, min_blocks = 1000, 64, 0.9, 1
    q, k = parity_inputs(4, n, 4, 2, "strong")
    v = np.random.default_rng(16).normal(size=(n, 2, 32)).astype(np.float32)
    ref = reference_selection(q, k, block=block, gamma=gamma, tau=0.0, min_budget_blocks=min_blocks,
                              max_budget_blocks=NO_LIMIT)
    tau = split_tau(ref.distance_H)
    want_mask, want_qaware = reference_block_mask(q, k, block=block, gamma=gamma, tau=tau,
                                                  min_budget_blocks=min_blocks, max_budget_blocks=NO_LIMIT)
    nb = blocks_of(n, block)
    want_mask &= causal_blocks(nb)
    out, density, qaware, sparse = fp.flexprefill_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
        options(block, gamma=gamma, tau=tau, min_blocks=min_blocks, budget_rule="reference", dense_above=1.0))
    assert sparse
    np.testing.assert_array_equal(qaware, want_qaware)
    np.testing.assert_allclose(density, want_mask.sum((1, 2)) / causal_blocks(nb).sum(), rtol=0, atol=1e-12)
    assert density.max() < 1
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v, want_mask, block), **F32_LARGE_LOGITS)


def test_dense_selection_falls_back_to_dense() -> None:
    """Diffuse random attention selects most blocks; above `dense_above` the op runs dense (density 1)."""
    n, block = 1000, 64
    q, k, v = random_qkv(17, n, 4, 2)
    want_mask, _ = reference_block_mask(q, k, block=block, gamma=0.95, tau=0.0, min_budget_blocks=1,
                                        max_budget_blocks=NO_LIMIT)
    nb = blocks_of(n, block)
    assert (want_mask & causal_blocks(nb)).sum() / (4 * causal_blocks(nb).sum()) > 0.5
    out, density, _, sparse = fp.flexprefill_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                       options(block, gamma=0.95, tau=0.0, budget_rule="reference"))
    np.testing.assert_array_equal(density, 1.0)
    assert not sparse
    np.testing.assert_allclose(np.asarray(out), np_attention(q, k, v), **F32_EXACT)


def test_block_lists_put_the_diagonal_first_and_mark_padding() -> None:
    nb, bucket = 12, 8
    mask = random_block_mask(18, 3, nb, 0.25)
    assert mask.sum(-1).max() <= bucket
    ids, valid = (np.asarray(x) for x in fp.block_lists(jnp.asarray(mask), bucket))
    assert ids.shape == valid.shape == (3, nb, bucket)
    np.testing.assert_array_equal(ids[:, :, 0], np.broadcast_to(np.arange(nb), (3, nb)))
    np.testing.assert_array_equal(valid.sum(-1), mask.sum(-1))
    for h in range(3):
        for r in range(nb):
            assert not valid[h, r, valid[h, r].sum():].any(), "a padding slot sits between listed blocks"
            assert sorted(ids[h, r][valid[h, r]]) == list(np.flatnonzero(mask[h, r]))


@pytest.mark.parametrize("n", [1024, 1100])
def test_pooled_slash_equals_the_pooled_distance_sums(n) -> None:
    """The slash distribution pooled in one pass over the probe equals the per-distance sums (a numpy loop
    over probe rows and keys) pooled into blocks, on and off the block grid."""
    block = 128
    rng = np.random.default_rng(21)
    logits = rng.standard_normal((3, block, n))
    visible = np.arange(n)[None, :] <= (n - block + np.arange(block))[:, None]
    probs = np.where(visible, np.exp(logits), 0.0)
    probs /= probs.sum(-1, keepdims=True)
    slash = np.zeros((3, n))
    for p in range(block):
        slash[:, block - 1 - p:] += probs[:, p, : n - (block - 1 - p)]
    nb = blocks_of(n, block)
    want = np.pad(slash / block, ((0, 0), (0, nb * block - n))).reshape(3, nb, block).sum(-1)
    vertical = fp._sum_pool(jnp.asarray(probs.mean(1), jnp.float32), block)
    got = fp._pooled_slash(jnp.asarray(probs, jnp.float32), vertical, block)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_heaviest_within_keeps_what_a_sorted_running_sum_keeps() -> None:
    """The threshold search keeps exactly the prefix of a descending stable sort whose running sum (float64
    here) is ≤ the budget: continuous values, many equal values (the ties kept in index order, part of a
    tie group when only part fits), zeros, budgets from nothing to more than the whole row."""
    rng = np.random.default_rng(5)
    rows = [rng.random((3, 257)), np.exp(rng.normal(0, 3, (3, 500))),
            rng.choice([0.0, 0.125, 0.25, 0.5, 1.0], size=(3, 300)), rng.integers(0, 3, (3, 64)) / 4]
    partial_ties = 0
    for x in rows:
        x = (x / x.max()).astype(np.float32)
        for budget in [0.0, 0.3, 0.5 * x.sum(1).min(), 0.97 * x.sum(1).max(), 2.0 * x.sum(1).max()]:
            got = np.asarray(fp._heaviest_within(jnp.asarray(x), float(budget)))
            for h in range(3):
                order = np.argsort(-x[h], kind="stable")
                want = np.zeros(x.shape[1], bool)
                want[order] = np.cumsum(x[h][order].astype(np.float64)) <= budget
                np.testing.assert_array_equal(got[h], want, err_msg=f"budget {budget}, row {h}")
                cut = x[h][want].min() if want.any() and not want.all() else None
                partial_ties += cut is not None and not want[x[h] == cut].all()
    assert partial_ties > 0, "no budget cut through a group of equal values; the tie rule went unchecked"


def test_zero_pooled_vertical_deviation_is_as_documented() -> None:
    """A key block the probe never sees (fp32 softmax underflows to 0 over the whole block) gives the
    official code a NaN distance, so that head is never query-aware; ours counts 0·log 0 as 0 (a documented
    deviation) and so marks it query-aware under a large τ."""
    n, block, h = 1000, 64, 32
    rng = np.random.default_rng(19)
    q = rng.normal(size=(n, 1, h)).astype(np.float32)
    k = rng.normal(size=(n, 1, h)).astype(np.float32)
    u = np.zeros(h, np.float32)
    u[0] = 1.0
    q[:, 0] += 20.0 * u
    k[block:2 * block, 0] -= 40.0 * u  # scores ≈ −140, far below the rest: exp underflows in fp32
    ref = reference_selection(q, k, block=block, gamma=0.9, tau=10.0, min_budget_blocks=1,
                              max_budget_blocks=NO_LIMIT, dtype=np.float32)
    assert ref.vertical_Hn[0, 1] == 0 and np.isnan(ref.distance_H[0]) and not ref.query_aware_H[0]
    got = select(q, k, options(block, gamma=0.9, tau=10.0))
    assert got.vertical_Hn[0, 1] == 0 and got.query_aware_H[0]
