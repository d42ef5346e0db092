"""Checkpoints that look right but compute another function: what `verify` must catch.

Each variant changes one layer of a (dense or MoE) checkpoint the way real conversion bugs do, and is
written with the plain writer (no function check): a perturbed copy, a dropped (zeroed) expert, gate and
up swapped, the two RoPE halves of every q/k head swapped, and a layer's FFN output scaled by 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from upcycler.io import read_checkpoint, write_checkpoint
from upcycler.tensors import constant


def _ffn(spec, layer: int) -> str:
    return f"layers.{layer}.moe.experts." if spec.is_moe_layer(layer) else f"layers.{layer}.mlp."


def perturbed(ckpt, layer: int) -> dict:
    """Every weight matrix of one layer × (1 + 1e-2 · N(0, 1)): a few bf16 ulps, as a lossy copy would do."""
    rng = np.random.default_rng(0)
    out = {}
    for name, t in ckpt.tensors.items():
        if name.startswith(f"layers.{layer}.") and len(t.shape) >= 2:
            w = t.load()
            noisy = w.astype(np.float32) * (1 + 1e-2 * rng.standard_normal(w.shape)).astype(np.float32)
            out[name] = constant(noisy.astype(w.dtype))
    return out


def dropped_expert(ckpt, layer: int, expert: int = 3) -> dict:
    """Expert `expert` of MoE layer `layer` left at zero (a converter that never filled it)."""
    p = _ffn(ckpt.spec, layer)
    out = {}
    for w in ("gate_proj", "up_proj", "down_proj"):
        values = ckpt.tensors[p + w].load().copy()
        values[expert] = 0
        out[p + w] = constant(values)
    return out


def swapped_gate_up(ckpt, layer: int) -> dict:
    p = _ffn(ckpt.spec, layer)
    return {p + "gate_proj": ckpt.tensors[p + "up_proj"], p + "up_proj": ckpt.tensors[p + "gate_proj"]}


def permuted_rope_halves(ckpt, layer: int) -> dict:
    """q_proj and k_proj rows of every head with their two halves swapped (the other RoPE convention)."""
    hd = ckpt.spec.head_dim
    out = {}
    for w in ("q_proj", "k_proj"):
        name = f"layers.{layer}.attn.{w}"
        values = ckpt.tensors[name].load()
        heads = values.reshape(-1, 2, hd // 2, values.shape[-1])
        out[name] = constant(heads[:, ::-1].reshape(values.shape).copy())
    return out


def doubled_layer(ckpt, layer: int) -> dict:
    """The FFN output of one layer × 2 (a scale applied twice)."""
    p = _ffn(ckpt.spec, layer)
    down = ckpt.tensors[p + "down_proj"].load()
    return {p + "down_proj": constant((down.astype(np.float32) * 2).astype(down.dtype))}


VARIANTS = {"perturbed": perturbed, "dropped-expert": dropped_expert, "swapped-gate-up": swapped_gate_up,
            "permuted-rope-halves": permuted_rope_halves, "doubled-layer": doubled_layer}


def write_variant(source: Path, out: Path, variant: str, layer: int) -> Path:
    """`source` with `variant` applied to `layer`, written to `out` without any function check."""
    ckpt = read_checkpoint(source)
    changed = VARIANTS[variant](ckpt, layer)
    return write_checkpoint(ckpt.replace(tensors=ckpt.tensors.updated(changed)), out, progress=False)
