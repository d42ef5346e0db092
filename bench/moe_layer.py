"""Benchmark the MoE layer alone: the dropless path against the one-hot reference and a dense lower bound.

    python bench/moe_layer.py            # T 8192, D 512, expert width 1024, 64 experts, top-8
    python bench/moe_layer.py --quick    # small sizes, seconds

Three layers, each timed forward and forward+backward (value and gradient of mean(y²) with respect to x
and every weight, router included for the MoE layers):
- `dropless`: route, sort by expert, grouped matmuls (`upcycler.train.model.moe.dropless_moe`);
- `onehot`: every expert on every token, masked (`onehot_moe_reference`), E/k times the FLOPs;
- `dense`: a SwiGLU FFN of width top_k·width, the same active FLOPs as the MoE: the lower bound.
Each function is jitted and compiled once, called once as a warm-up, then the repeats run round-robin over
the functions (so a machine shared with other work slows all of them alike) and the median is reported,
in wall seconds and in process CPU seconds. Memory is XLA's compiled `memory_analysis()` temp bytes, also
for the dropless layer at a smaller expert count with the same active FLOPs, to show that it does not grow
with E. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
from common import time_round_robin

from upcycler.train.model import moe
from upcycler.train.model.gmm import resolve_backend

FB_TARGET = 1.2  # dropless forward+backward within this factor of the dense lower bound
ONEHOT_SPEEDUP_TARGET = 1.7


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024, help="expert width F")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--small-experts", type=int, default=None, help="E for the memory comparison")
    parser.add_argument("--router", default="renormalized", choices=moe.ROUTER_KINDS)
    parser.add_argument("--backend", default="auto", choices=("auto", "tiled", "ragged_dot", "mosaic_gpu"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="activations and expert weights (the router stays float32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="T 1024, D 128, width 256, 16 experts, top-4")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.d_model, args.width, args.experts, args.topk = 1024, 128, 256, 16, 4
        args.repeats = min(args.repeats, 3)
    if args.small_experts is None:
        args.small_experts = max(args.topk, args.experts // 8)
    return args


def moe_params(key: jax.Array, tokens: int, d: int, width: int, experts: int,
               dtype: str = "float32") -> tuple[jax.Array, ...]:
    """x_TD, w_gate_up_EDU, w_down_EDF (in `dtype`), w_router_ED (float32) with unit-variance activations."""
    k = jax.random.split(key, 4)
    return (
        jax.random.normal(k[0], (tokens, d)).astype(dtype),
        (jax.random.normal(k[1], (experts, d, 2 * width)) * d**-0.5).astype(dtype),
        (jax.random.normal(k[2], (experts, d, width)) * width**-0.5).astype(dtype),
        jax.random.normal(k[3], (experts, d)) * d**-0.5,
    )


def dense_params(key: jax.Array, tokens: int, d: int, width: int, dtype: str = "float32") -> tuple[jax.Array, ...]:
    """x_TD, w_gate_up_DH, w_down_FD in `dtype` for a SwiGLU of width `width`."""
    k = jax.random.split(key, 3)
    return (
        jax.random.normal(k[0], (tokens, d)).astype(dtype),
        (jax.random.normal(k[1], (d, 2 * width)) * d**-0.5).astype(dtype),
        (jax.random.normal(k[2], (width, d)) * width**-0.5).astype(dtype),
    )


def moe_layer(impl: str, top_k: int, router: str, backend: str) -> Callable[..., jax.Array]:
    def layer(x_TD, w_gate_up_EDU, w_down_EDF, w_router_ED):
        routing = moe.route(moe.router_logits(x_TD, w_router_ED), top_k, router)
        if impl == "onehot":
            return moe.onehot_moe_reference(x_TD, w_gate_up_EDU, w_down_EDF, routing)
        return moe.dropless_moe(x_TD, w_gate_up_EDU, w_down_EDF, routing, backend=backend)

    return layer


def dense_layer(x_TD, w_gate_up_DH, w_down_FD):
    return moe.swiglu(x_TD @ w_gate_up_DH) @ w_down_FD


def compiled_pair(layer: Callable[..., jax.Array], params: tuple[jax.Array, ...]):
    """(forward, forward+backward) compiled for `params`."""

    def loss(*args):
        return jnp.mean(layer(*args).astype(jnp.float32) ** 2)

    argnums = tuple(range(len(params)))
    fwd = jax.jit(layer).lower(*params).compile()
    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=argnums)).lower(*params).compile()
    return fwd, fwd_bwd


def temp_bytes(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def summarise(times: dict, compiled: dict, small_name: str, small: tuple) -> dict:
    """Seconds, ratios, speedup, temp memory and target checks from the medians in `times`."""
    phases = ("fwd", "fwd_bwd")

    def seconds(name: str, clock: str) -> dict[str, float]:
        return {p: round(times[f"{name}/{p}"][clock], 4) for p in phases}

    def ratio(a: str, b: str) -> dict[str, float]:
        return {p: round(times[f"{a}/{p}"]["wall"] / times[f"{b}/{p}"]["wall"], 3) for p in phases}

    memory = {name: dict(zip(phases, map(temp_bytes, pair), strict=True)) for name, pair in compiled.items()}
    memory[small_name] = dict(zip(phases, map(temp_bytes, small), strict=True))
    to_dense = {name: ratio(name, "dense") for name in ("dropless", "onehot")}
    speedup = ratio("onehot", "dropless")
    return {
        "seconds": {name: seconds(name, "wall") for name in compiled},
        "cpu_seconds": {name: seconds(name, "cpu") for name in compiled},
        "ratio_to_dense": to_dense,
        "onehot_over_dropless": speedup,
        "temp_bytes": memory,
        "targets": {
            f"dropless_fwd_bwd_le_{FB_TARGET}x_dense": to_dense["dropless"]["fwd_bwd"] <= FB_TARGET,
            f"onehot_over_dropless_ge_{ONEHOT_SPEEDUP_TARGET}x": speedup["fwd_bwd"] >= ONEHOT_SPEEDUP_TARGET,
        },
    }


def main() -> None:
    args = parse_args()
    key = jax.random.key(0)
    T, D, F, E, K = args.tokens, args.d_model, args.width, args.experts, args.topk
    backend = resolve_backend(args.backend, dtype=args.dtype)
    moe_args, dense_args = moe_params(key, T, D, F, E, args.dtype), dense_params(key, T, D, K * F, args.dtype)
    compiled = {
        "dropless": compiled_pair(moe_layer("dropless", K, args.router, backend), moe_args),
        "onehot": compiled_pair(moe_layer("onehot", K, args.router, backend), moe_args),
        "dense": compiled_pair(dense_layer, dense_args),
    }
    small_args = moe_params(key, T, D, F, args.small_experts, args.dtype)
    small = compiled_pair(moe_layer("dropless", K, args.router, backend), small_args)

    params = {"dropless": moe_args, "onehot": moe_args, "dense": dense_args}
    calls = {}
    for name, (fwd, fwd_bwd) in compiled.items():
        calls[f"{name}/fwd"] = (fwd, params[name])
        calls[f"{name}/fwd_bwd"] = (fwd_bwd, params[name])
    times = time_round_robin(calls, args.repeats)

    shape_args = ("tokens", "d_model", "width", "experts", "topk", "router")
    config = {name: getattr(args, name) for name in shape_args}
    config.update(backend=backend, dtype=args.dtype, repeats=args.repeats, devices=jax.device_count())
    result = {"bench": "moe_layer", "config": config}
    result.update(summarise(times, compiled, f"dropless_E{args.small_experts}", small))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
