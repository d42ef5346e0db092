"""The dropless MoE layer core: grouped matmul backends, router kinds, dispatch, losses, capacity.

Every check compares against an independent implementation: the other gmm backend, the dense one-hot
layer, or numpy written here. Sizes are tiny and fp32 so the whole file runs in seconds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_checks import TPU_AUTO
from moe_capacity_reference import capacity_moe, expert_capacity

from upcycler.train.model import moe
from upcycler.train.model.gmm import gmm, resolve_backend

T, D, F, E = 40, 8, 6, 6
SMALL_TILES = (16, 4)  # several tile sizes and masked tails even at these sizes
TOL = {"rtol": 2e-5, "atol": 2e-5}


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


def _layer_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "x_TD": _normal(rng, (T, D)),
        "w_gate_up_EDU": _normal(rng, (E, D, 2 * F), 0.4),
        "w_down_EDF": _normal(rng, (E, D, F), 0.4),
        "w_router_ED": _normal(rng, (E, D), 0.5),
    }


# ------------------------------------------------------------------------------------------------- gmm

GROUP_SIZES = {
    "mixed_with_empty": [5, 0, 17, 3, 0, 9],
    "all_in_one": [0, 0, 34, 0, 0, 0],
    "all_in_last": [0, 0, 0, 0, 0, 34],
    "singletons": [1, 1, 1, 1, 1, 1],
    "none": [0, 0, 0, 0, 0, 0],
    "tile_multiples": [16, 4, 0, 8, 4, 2],
}
GMM_ROWS = 37  # more than any pattern's total: trailing rows outside every group must come out zero


def _gmm_with_grads(backend: str, tile_rows: tuple[int, ...]):
    """One compiled function per backend: output and (dx, dw) of sum(out * cotangent)."""

    def run(x, w, group_sizes, cotangent):
        out, vjp = jax.vjp(lambda x, w: gmm(x, w, group_sizes, backend=backend, tile_rows=tile_rows), x, w)
        return out, vjp(cotangent)

    return jax.jit(run)


@pytest.mark.parametrize("tile_rows", [SMALL_TILES, (64,)])
def test_tiled_gmm_matches_ragged_dot(tile_rows: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    x, w, cotangent = _normal(rng, (GMM_ROWS, 7)), _normal(rng, (E, 7, 5)), _normal(rng, (GMM_ROWS, 5))
    tiled, ragged = _gmm_with_grads("tiled", tile_rows), _gmm_with_grads("ragged_dot", tile_rows)
    for name, sizes in GROUP_SIZES.items():
        group_sizes = jnp.asarray(sizes, jnp.int32)
        out, grads = tiled(x, w, group_sizes, cotangent)
        want_out, want_grads = ragged(x, w, group_sizes, cotangent)
        np.testing.assert_allclose(out, want_out, err_msg=name, **TOL)
        np.testing.assert_array_equal(out[sum(sizes) :], 0.0, err_msg=name)
        for got, want in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(got, want, err_msg=name, **TOL)


def test_gmm_backend_choice_and_shape_errors() -> None:
    expected = {"cpu": "tiled", "tpu": TPU_AUTO, "gpu": "tiled"}.get(jax.default_backend(), "ragged_dot")
    assert resolve_backend("auto") == expected
    assert [resolve_backend("auto", p) for p in ("cpu", "tpu", "gpu", "rocm")] == ["tiled", TPU_AUTO, "tiled", "ragged_dot"]
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"w is \[G, in, out\]"):
        gmm(jnp.zeros((4, 3)), jnp.zeros((2, 5, 3)), jnp.array([2, 2]))


# ----------------------------------------------------------------------------------------------- router


def _np_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _np_route(logits, k, kind, scale, bias):
    """Router written from the Hugging Face descriptions, one token at a time."""
    experts, weights = [], []
    for row in np.asarray(logits, np.float64):
        scores = 1 / (1 + np.exp(-row)) if kind == "sigmoid" else _np_softmax(row)
        choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
        chosen = np.argsort(-choice, kind="stable")[:k]
        w = scores[chosen]
        if kind != "unnormalized":
            w = w / w.sum()
        experts.append(chosen)
        weights.append(w * scale)
    return np.array(experts), np.array(weights)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kind", moe.ROUTER_KINDS)
def test_route_matches_numpy(kind: str, with_bias: bool) -> None:
    rng = np.random.default_rng(2)
    logits, k, scale = _normal(rng, (T, E), 2.0), 3, 2.5
    bias = _normal(rng, (E,), 1.0) if with_bias else None
    got = moe.route(logits, k, kind, scale, bias)
    experts, weights = _np_route(logits, k, kind, scale, bias)
    np.testing.assert_array_equal(got.expert_Tk, experts)
    np.testing.assert_allclose(got.weight_Tk, weights, rtol=1e-5, atol=1e-6)
    assert got.expert_Tk.dtype == jnp.int32 and got.weight_Tk.dtype == jnp.float32


def test_route_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="router_kind"):
        moe.route(jnp.zeros((2, E)), 2, "softmax")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- dropless vs one-hot

ROUTINGS = {
    # name: (router kind, top-k, selection bias; a large bias forces the choice, the weights stay unbiased)
    "random_renormalized": ("renormalized", 2, [0.0] * E),
    "experts_without_tokens": ("renormalized", 2, [30.0, 0.0, 30.0, 0.0, 0.0, 30.0]),
    "all_tokens_on_one_expert": ("unnormalized", 1, [0.0, 0.0, 0.0, 50.0, 0.0, 0.0]),
    "random_sigmoid_with_bias": ("sigmoid", 3, [0.3, -0.2, 0.0, 0.1, -0.4, 0.2]),
}


def _routing(params: dict[str, jax.Array], kind: str, k: int, bias_E: jax.Array) -> moe.Routing:
    logits = moe.router_logits(params["x_TD"], params["w_router_ED"])
    return moe.route(logits, k, kind, 1.5 if kind == "sigmoid" else 1.0, bias_E)


@functools.cache
def _layer_with_grads(kind: str, k: int, backend: str | None):
    """One compiled function per (router, top-k, implementation): y and the gradients of sum(y * cotangent).

    backend None is the one-hot reference. Gradients are taken for x, every expert weight and the router.
    """

    def layer(params, bias_E):
        weights = (params["w_gate_up_EDU"], params["w_down_EDF"])
        routing = _routing(params, kind, k, bias_E)
        if backend is None:
            return moe.onehot_moe_reference(params["x_TD"], *weights, routing)
        return moe.dropless_moe(params["x_TD"], *weights, routing, backend=backend, tile_rows=SMALL_TILES)

    def run(params, bias_E, cotangent):
        out, vjp = jax.vjp(lambda p: layer(p, bias_E), params)
        return out, vjp(cotangent)[0]

    return jax.jit(run)


@functools.cache
def _layer_case(name: str, backend: str | None):
    kind, k, bias = ROUTINGS[name]
    cotangent = _normal(np.random.default_rng(3), (T, D))
    return _layer_with_grads(kind, k, backend)(_layer_params(), jnp.asarray(bias, jnp.float32), cotangent)


LAYER_CASES = [(name, "tiled") for name in ROUTINGS] + [("random_renormalized", "ragged_dot"),
                                                          ("experts_without_tokens", "megablox")]


@pytest.mark.parametrize("name,backend", LAYER_CASES)
def test_dropless_matches_onehot_reference(name: str, backend: str) -> None:
    (out, grads), (want_out, want_grads) = _layer_case(name, backend), _layer_case(name, None)
    np.testing.assert_allclose(out, want_out, **TOL)
    for key, want in want_grads.items():
        assert float(jnp.max(jnp.abs(want))) > 0, key
        np.testing.assert_allclose(grads[key], want, err_msg=key, **TOL)


def test_forced_routing_really_leaves_experts_idle() -> None:
    params = _layer_params()
    for name, expected_busy in [("experts_without_tokens", {0, 2, 5}), ("all_tokens_on_one_expert", {3})]:
        kind, k, bias = ROUTINGS[name]
        routing = _routing(params, kind, k, jnp.asarray(bias, jnp.float32))
        assert set(np.unique(routing.expert_Tk).tolist()) == expected_busy


def _np_kept_copies(experts_Tk: np.ndarray, capacity: int) -> np.ndarray:
    """Copies kept under a capacity: per expert, the first `capacity` copies in order t·k + j."""
    seen = np.zeros(E, int)
    kept = np.zeros(experts_Tk.size, bool)
    for n, e in enumerate(experts_Tk.reshape(-1)):
        kept[n] = seen[e] < capacity
        seen[e] += 1
    return kept.reshape(experts_Tk.shape)


_jit_reference = jax.jit(moe.onehot_moe_reference)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_capacity_drops_the_latest_copies(capacity_factor: float) -> None:
    params = _layer_params(seed=4)
    weights = (params["w_gate_up_EDU"], params["w_down_EDF"])
    routing = _routing(params, "renormalized", 2, jnp.zeros(E))
    capacity = expert_capacity(T, 2, E, capacity_factor)
    kept = _np_kept_copies(np.asarray(routing.expert_Tk), capacity)
    assert not kept.all()
    reference_routing = moe.Routing(routing.expert_Tk, jnp.where(kept, routing.weight_Tk, 0.0))
    want = _jit_reference(params["x_TD"], *weights, reference_routing)
    layer = jax.jit(capacity_moe, static_argnames=("backend", "capacity_factor", "tile_rows"))
    options = {"capacity_factor": capacity_factor, "tile_rows": SMALL_TILES}
    for backend in ("tiled", "ragged_dot"):
        got = layer(params["x_TD"], *weights, routing, backend=backend, **options)
        np.testing.assert_allclose(got, want, err_msg=backend, **TOL)


def test_gate_up_layout_and_swiglu_gradient() -> None:
    rng = np.random.default_rng(9)
    w_gate, w_up = _normal(rng, (E, D, F)), _normal(rng, (E, D, F))
    fused = moe.fuse_gate_up(w_gate, w_up)
    assert fused.shape == (E, D, 2 * F)
    for got, want in zip(moe.split_gate_up(fused), (w_gate, w_up), strict=True):
        np.testing.assert_array_equal(got, want)
    h, cotangent = _normal(rng, (T, 2 * F), 3.0), _normal(rng, (T, F))

    def plain(h):
        return jax.nn.silu(h[:, :F]) * h[:, F:]

    np.testing.assert_allclose(moe.swiglu(h), plain(h), **TOL)
    got = jax.vjp(moe.swiglu, h)[1](cotangent)[0]
    np.testing.assert_allclose(got, jax.vjp(plain, h)[1](cotangent)[0], **TOL)


def test_dropless_bfloat16_close_to_fp32_reference() -> None:
    params = _layer_params()
    weights = (params["w_gate_up_EDU"], params["w_down_EDF"])
    routing = _routing(params, "renormalized", 2, jnp.zeros(E))
    want = _jit_reference(params["x_TD"], *weights, routing)
    bf16 = [a.astype(jnp.bfloat16) for a in (params["x_TD"], *weights)]
    got = jax.jit(moe.dropless_moe, static_argnames="tile_rows")(*bf16, routing, tile_rows=SMALL_TILES)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=5e-2, atol=5e-2)


def test_layer_rejects_mismatched_weights() -> None:
    params = _layer_params()
    routing = _routing(params, "renormalized", 2, jnp.zeros(E))
    with pytest.raises(ValueError, match=r"w_down_EDF \[E, D, F\]"):
        moe.dropless_moe(params["x_TD"], params["w_gate_up_EDU"], jnp.zeros((E, D, F + 1)), routing)


# ---------------------------------------------------------------------------------------- losses, stats


lb_loss = jax.jit(moe.load_balancing_loss, static_argnums=(3, 4))
z_loss = jax.jit(moe.router_z_loss)
expert_load = jax.jit(moe.expert_load, static_argnums=2)


def _np_lb_loss(logits, topk, mask, num_experts):
    probs, mask = _np_softmax(np.asarray(logits, np.float64)), np.asarray(mask, bool)
    counts = np.bincount(np.asarray(topk)[mask].reshape(-1), minlength=num_experts)
    f = counts / counts.sum()
    p = probs[mask].mean(0)
    return num_experts * float(f @ p)


def test_lb_loss_is_one_when_uniform_and_E_when_collapsed() -> None:
    rng = np.random.default_rng(5)
    uniform_idx = jnp.arange(E * 4 * 2, dtype=jnp.int32).reshape(E * 4, 2) % E  # every expert 8 times
    logits = _normal(rng, (E * 4, E), 3.0)  # any probabilities: uniform counts make the loss 1
    assert float(lb_loss(logits, uniform_idx, None, E)) == pytest.approx(1.0, abs=1e-6)
    collapsed_logits = jnp.zeros((T, E)).at[:, 2].set(200.0)
    collapsed_idx = jnp.full((T, 1), 2, jnp.int32)
    assert float(lb_loss(collapsed_logits, collapsed_idx, None, E)) == pytest.approx(E, rel=1e-6)


@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_lb_loss_ignores_padding(scope: str) -> None:
    rng = np.random.default_rng(6)
    b, length, pad, k = 3, 10, 5, 2
    logits = _normal(rng, (b, length, E), 2.0)
    topk = moe.route(logits.reshape(-1, E), k, "renormalized").expert_Tk.reshape(b, length, k)
    mask = jnp.ones((b, length))
    base = lb_loss(logits, topk, mask, E, scope)
    pad_logits = jnp.concatenate([logits, _normal(rng, (b, pad, E), 9.0)], axis=1)
    pad_topk = jnp.concatenate([topk, jnp.zeros((b, pad, k), jnp.int32)], axis=1)
    pad_mask = jnp.concatenate([mask, jnp.zeros((b, pad))], axis=1)
    padded = lb_loss(pad_logits, pad_topk, pad_mask, E, scope)
    assert float(padded) == pytest.approx(float(base), rel=1e-6)
    if scope == "batch":
        assert float(base) == pytest.approx(_np_lb_loss(logits, topk, mask, E), rel=1e-5)
    else:
        per_sequence = [_np_lb_loss(logits[i], topk[i], mask[i], E) for i in range(b)]
        assert float(base) == pytest.approx(np.mean(per_sequence), rel=1e-5)


def test_lb_loss_gradient_flows_only_through_probabilities() -> None:
    rng = np.random.default_rng(7)
    logits = _normal(rng, (T, E))
    topk = moe.route(logits, 2, "renormalized").expert_Tk
    grad = jax.jit(jax.grad(moe.load_balancing_loss), static_argnums=3)(logits, topk, None, E)
    # f is a constant count, so d/dlogits of E·Σ f·mean_t(p_t) is (E/T)·p_t ⊙ (f − p_t·f) per token.
    p = _np_softmax(np.asarray(logits, np.float64))
    f = np.bincount(np.asarray(topk).ravel(), minlength=E) / (2 * T)
    want = E / T * p * (f - (p @ f)[:, None])
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)


def test_z_loss_and_expert_load_match_numpy() -> None:
    rng = np.random.default_rng(8)
    logits, mask = _normal(rng, (4, 9, E), 3.0), jnp.asarray(rng.random((4, 9)) > 0.3)
    z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    want = (z**2)[np.asarray(mask)].mean()
    assert float(z_loss(logits, mask)) == pytest.approx(want, rel=1e-5)
    topk = jnp.asarray(rng.integers(0, E, (4, 9, 2)), jnp.int32)
    load = expert_load(topk, mask, E)
    np.testing.assert_array_equal(load, np.bincount(np.asarray(topk)[np.asarray(mask)].ravel(), minlength=E))
    assert load.dtype == jnp.int32


def _primitive_count(jaxpr, name: str) -> int:
    """How often primitive `name` appears in `jaxpr` and every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _primitive_count(inner, name)
    return count


@pytest.mark.parametrize("policy", ["full", "qkv"])
def test_remat_keeps_the_dispatch_plan_so_the_backward_does_not_sort_again(policy: str) -> None:
    from upcycler.train.model import remat

    params = _layer_params()
    weights = (params["w_gate_up_EDU"], params["w_down_EDF"])

    def loss(x_TD, remat_policy):
        routing = _routing({**params, "x_TD": x_TD}, "renormalized", 2, jnp.zeros(E))
        layer = lambda x: moe.dropless_moe(x, *weights, routing, backend="tiled", tile_rows=SMALL_TILES)
        if remat_policy is not None:
            layer = jax.checkpoint(layer, policy=remat_policy, prevent_cse=False)
        return jnp.sum(layer(x_TD) ** 2)

    plain = jax.make_jaxpr(jax.grad(lambda x: loss(x, None)))(params["x_TD"]).jaxpr
    kept = jax.make_jaxpr(jax.grad(lambda x: loss(x, remat.policy(policy))))(params["x_TD"]).jaxpr
    recomputed_all = jax.make_jaxpr(jax.grad(lambda x: loss(x, jax.checkpoint_policies.nothing_saveable)))
    assert _primitive_count(plain, "sort") >= 1
    assert _primitive_count(kept, "sort") == _primitive_count(plain, "sort")
    # what keeping the plan saves: without it the recomputed forward pass sorts the copies again
    assert _primitive_count(recomputed_all(params["x_TD"]).jaxpr, "sort") > _primitive_count(plain, "sort")
    np.testing.assert_allclose(jax.grad(lambda x: loss(x, remat.policy(policy)))(params["x_TD"]),
                               jax.grad(lambda x: loss(x, None))(params["x_TD"]), **TOL)
