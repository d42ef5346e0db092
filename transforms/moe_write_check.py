"""The check a `dense-to-moe` write runs on what it wrote, at a fraction of the write's cost.

The full check (`upcycler.verify.check_written`) reads the whole output back and runs three forward passes:
about nine times the write. This one rides on the write instead. The writer hashes every tensor's bytes
as they go to disk (xxh3-128, `ShardWriter`, recorded in `upcycler.json`), streamed or produced, and
this check proves, without reading the output's experts back or running the model:

1. Verbatim tensors. Every tensor outside the MoE blocks (attention, norms, embeddings, head, the dense
   first layers) holds its source tensor's bytes, cast to the output dtype when that is wider: the digest
   of what was written equals the digest of the source tensor, streamed from the source file here. A
   tensor the target family adds (a zero bias, Qwen2-MoE's shared gate, a router bias) holds zeros.
2. Expert placement. Routed expert e of MoE layer i holds member e mod R's window of layer i's dense MLP
   (gate and up rows, down columns times their scale; `expert_cover`), and the shared expert the first
   neurons (down doubled when gated): each written digest equals that of the window cut here from the
   source, once per distinct window, not once per expert. A tensor in the wrong expert slot, a zeroed or
   perturbed expert, gate and up swapped: each is named by layer, expert and projection.
3. The windows compute the dense MLP. On probe vectors aimed at every virtual group's router row (the
   router as written, read back: a few KiB), the MoE block built from those windows, that router and the
   family's routing (renormalised softmax, sigmoid with the routed scaling factor, or plain softmax) gives
   the dense MLP's output within `NOISE_FACTOR` × the layer's own fp32 noise floor (the dense MLP against
   itself with its neurons in another order, at least an fp32 ulp of its largest output). Router rows of
   one group must be bitwise equal (so top-k picks whole groups, ties included).
4. The config. `config.json` as written reads back as the planned model, and every setting of the
   source's config that decides the function and that the output family also writes (`rms_norm_eps`, the
   RoPE settings, tying, vocabulary and attention shapes, activation) has the source's value.

What it does not cover: the attention and the rest of the model run by another implementation (that is
what `upcycle verify A B` does, end to end, on demand), and recipes other than one exact `dense-to-moe`
step without `--experts-from` (those keep the full check).

Cost: about one read of the source's MLP and non-MLP bytes from the page cache, an xxh3 pass over them,
and P × the dense MLP's FLOPs per layer (P = the number of virtual groups, at least `MIN_PROBES`); memory: one
layer's dense MLP and one window at a time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from upcycler.errors import UpcyclerError
from upcycler.families import family_named
from upcycler.io import read_checkpoint
from upcycler.io.hashing import tensor_digest
from upcycler.io.hf_read import read_spec
from upcycler.io.manifest import read_manifest
from upcycler.layout import declare_params, layer_prefix
from upcycler.spec import ModelSpec
from upcycler.tensors import BF16, LazyTensor, StoredBytes
from upcycler.transforms.dense_to_moe import DenseToMoE, cover_for, router_factor, scale_columns
from upcycler.transforms.expert_cover import Cover
from upcycler.untrusted import shown_path

NOISE_FACTOR = 10.0  # the MoE block may differ from the dense MLP by this many times the layer's own floor
FP32_ULP = 2.0**-23
MIN_PROBES = 8  # probe vectors per layer at least (one per virtual group when there are more groups)
CHUNK = 2048  # neurons converted to fp32 at a time
READ = 8 << 20  # bytes hashed at a time when a source tensor is streamed from its file
# settings of an HF config that decide the function; each the source has must reach the output unchanged
FUNCTION_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
                 "tie_word_embeddings", "hidden_act", "attention_bias", "max_position_embeddings",
                 "sliding_window", "attention_dropout")


@dataclass(frozen=True)
class WriteCheck:
    """The in-stream check of one exact `dense-to-moe` write from `source`; call it on the staged output."""

    source: Path
    config: DenseToMoE
    spec: ModelSpec  # the output's, as planned
    what: str = "dense-to-moe"

    def __call__(self, staged: Path) -> dict[str, Any]:
        written = read_manifest(staged).tensor_xxh3()
        source = read_checkpoint(self.source).replace(watches=())
        output = read_checkpoint(staged).replace(watches=())
        out_dtype = np.dtype(output.tensors["embed"].dtype)
        family = family_named(self.spec.family)
        cover = cover_for(self.config, source.spec)
        moe_layers = set(self.spec.moe_layers)
        by_digest = 0
        worst: tuple[float, int] = (0.0, -1)
        self._check_config(staged)
        for decl in declare_params(self.spec):
            names = family.hf_names(decl)
            layer = _layer_of(decl.name)
            if layer in moe_layers and ".moe." in decl.name:
                continue  # the block's tensors, below
            parent = source.tensors.get(decl.name)
            if parent is None and decl.name == "lm_head" and source.spec.tie_embeddings:
                parent = source.tensors["embed"]  # untied in a family that never ties: a copy of the embedding
            expected = _source_digest(parent, decl.shape, out_dtype)
            where = "" if layer is None else f"layer {layer}: "
            self._same(written, names[0], expected, f"{where}{decl.name} should hold the source's tensor"
                       if parent is not None else f"{where}{decl.name} should be zeros")
            by_digest += 1
        for i in self.spec.moe_layers:
            ratio, count = self._check_block(i, cover, source.tensors, output.tensors, written, family, out_dtype)
            by_digest += count
            worst = max(worst, (ratio, i))
        groups = self.spec.moe.num_experts // cover.group  # type: ignore[union-attr]
        probes = max(groups, MIN_PROBES)
        line = (f"same function: every tensor holds the bytes it should ({by_digest:,} by digest as written), "
                f"and each of the {len(moe_layers)} MoE blocks gives its dense MLP's output on {probes} probes "
                f"aimed at its {groups} virtual groups within {NOISE_FACTOR:g} × its fp32 noise floor "
                f"(worst: layer {worst[1]}, {worst[0]:.2g} × the floor); config.json has the source's settings")
        return {"method": "in-stream", "against": Path(self.source).name, "tensors_by_digest": by_digest,
                "moe_layers": len(moe_layers), "probes_per_layer": probes, "worst_floor_ratio": worst[0],
                "allowed_floor_ratio": NOISE_FACTOR, "passed": True, "verdict": line}

    # --- one MoE block ------------------------------------------------------------------------------------
    def _check_block(self, i: int, cover: Cover, source: dict, output: dict, written: dict[str, str],
                     family, out_dtype: np.dtype) -> tuple[float, int]:
        """Digests of every expert of layer `i` against its window; then the block against the dense MLP.
        Returns (the block's largest difference in units of its noise floor, tensors checked)."""
        moe = self.spec.moe
        assert moe is not None
        p = layer_prefix(i)
        R, N = cover.group, moe.num_experts
        factor = router_factor(moe, R)
        dense = [source[p + f"mlp.{w}"] for w in ("gate_proj", "up_proj", "down_proj")]
        names = {d.name: family.hf_names(d) for d in declare_params(self.spec) if d.name.startswith(p + "moe.")}
        down = _load(dense[2])  # [D, F]
        scales = [np.full(cover.width, factor) if cover.overlap == 0 else cover.column_scales(j, factor)
                  for j in range(R)]
        count = 0
        for j in range(R):  # each distinct window once; every member e with e mod R = j must hold it
            window = cover.window(j)
            digests = {
                "gate_proj": _rows_digest(dense[0], window, out_dtype),
                "up_proj": _rows_digest(dense[1], window, out_dtype),
                "down_proj": tensor_digest(_down_window(down, window, scales[j], factor, cover, self._scaled_dtype(
                    dense[2].dtype, out_dtype)).astype(out_dtype)),
            }
            for w, digest in digests.items():
                hf = names[p + f"moe.experts.{w}"]
                for e in range(j, N, R):
                    self._same(written, hf[e], digest, f"layer {i}: routed expert {e}'s {w} should hold "
                               f"{_neurons(window)} of the dense {w}" + (" scaled" if w == "down_proj" else ""))
                    count += 1
        double = 2.0 if moe.shared_gated else 1.0
        if cover.shared:
            shared = slice(0, cover.shared)
            for w, digest in (("gate_proj", _rows_digest(dense[0], shared, out_dtype)),
                              ("up_proj", _rows_digest(dense[1], shared, out_dtype)),
                              ("down_proj", tensor_digest(scale_columns(np.ascontiguousarray(down[:, shared]), double)
                                                          .astype(out_dtype)))):
                self._same(written, names[p + f"moe.shared.{w}"][0], digest,
                           f"layer {i}: the shared expert's {w} should hold the first {cover.shared} neurons of "
                           f"the dense {w}" + (" doubled (its gate gives 1/2)" if double != 1 and w == "down_proj" else ""))
                count += 1
        handled = {p + f"moe.experts.{w}" for w in ("gate_proj", "up_proj", "down_proj")} | \
                  {p + f"moe.shared.{w}" for w in ("gate_proj", "up_proj", "down_proj")} | {p + "moe.router"}
        for name, hf in names.items():  # what the family adds to the block: zeros
            if name not in handled:
                tensor = output[name]
                self._same(written, hf[0], tensor_digest(np.zeros(tensor.shape, tensor.dtype)),
                           f"layer {i}: {name} should be zeros")
                count += 1
        router = np.asarray(output[p + "moe.router"].load(), np.float32)
        for g in range(N // R):
            rows = router[g * R:(g + 1) * R]
            if not (rows == rows[0]).all():
                raise self._fail(f"layer {i}: the router rows of virtual group {g} (experts {g * R}–"
                                 f"{(g + 1) * R - 1}) differ, so top-k can split the group")
        gate_bias = output.get(p + "moe.shared_gate")
        bias = output.get(p + "moe.router_bias")
        ratio = self._probe(i, cover, dense, down, router, scales,
                            None if gate_bias is None else np.asarray(gate_bias.load(), np.float32),
                            None if bias is None else np.asarray(bias.load(), np.float32), double)
        return ratio, count

    def _probe(self, i: int, cover: Cover, dense: list[LazyTensor], down: np.ndarray, router: np.ndarray,
               scales: list[np.ndarray], shared_gate: np.ndarray | None, router_bias: np.ndarray | None,
               double: float) -> float:
        """The MoE block from the windows and the written router against the dense MLP on probes aimed at
        every virtual group; raises past `NOISE_FACTOR` × the floor, else returns the ratio."""
        moe = self.spec.moe
        assert moe is not None
        R, N, K = cover.group, moe.num_experts, moe.top_k
        D = router.shape[1]
        rng = np.random.default_rng([i, 7])
        groups = N // R
        probes = max(groups, MIN_PROBES)
        x = rng.standard_normal((probes, D)).astype(np.float32)
        for g in range(groups):  # aim probe g at group g's row: its logit then tops the others
            row = router[g * R]
            norm = float(np.linalg.norm(row))
            if norm > 0:
                x[g] = 0.5 * x[g] + row * (4.0 * np.sqrt(D) / norm)
        h = _silu(_times(x, dense[0])) * _times(x, dense[1])  # [P, F], fp32
        down32 = _to_f32(down)
        want = h @ down32.T
        perm = rng.permutation(h.shape[1])
        reordered = sum(h[:, c] @ down32[:, c].T for c in np.array_split(perm, max(1, len(perm) // CHUNK)))
        floor = max(float(np.abs(reordered - want).max()), FP32_ULP * float(np.abs(want).max()))
        parts = [(h[:, cover.window(j)] * scales[j].astype(np.float32)) @ down32[:, cover.window(j)].T
                 for j in range(R)]
        weights, chosen = _route(x @ router.T, moe.router, K, moe.routed_scaling_factor, router_bias)
        got = np.zeros_like(want)
        for k in range(K):
            e = chosen[:, k]
            got += weights[:, k:k + 1] * np.stack([parts[j][n] for n, j in enumerate(e % R)])
        if cover.shared:
            shared = h[:, :cover.shared] @ (down32[:, :cover.shared] * np.float32(double)).T
            if shared_gate is not None:
                shared = shared / (1 + np.exp(-(x @ shared_gate.reshape(-1))))[:, None]
            got += shared
        worst = float(np.abs(got - want).max())
        if not worst <= NOISE_FACTOR * floor:
            raise self._fail(f"layer {i}: the MoE block's output differs from the dense MLP's by {worst:.2e} "
                             f"> {NOISE_FACTOR:g} × its fp32 noise floor {floor:.1e} on {probes} probes aimed at its "
                             "virtual groups")
        return worst / floor

    # --- helpers ------------------------------------------------------------------------------------------
    def _scaled_dtype(self, source: np.dtype, output: np.dtype) -> np.dtype:
        """The dtype the transform scales routed down_proj in: the source's, or the output's where wider."""
        return np.dtype(output) if np.dtype(output).itemsize > np.dtype(source).itemsize else np.dtype(source)

    def _check_config(self, staged: Path) -> None:
        """config.json reads back as the planned spec and keeps the source's function settings."""
        got = read_spec(staged)
        differ = [k for k, v in self.spec.__dict__.items() if getattr(got, k, None) != v]
        if differ == ["intermediate_size"] and _shapes(got) == _shapes(self.spec):
            differ = []  # a dense width no layer uses (every layer is MoE): not every family writes it
        if differ:
            raise self._fail(f"config.json reads back as another model than planned ({', '.join(differ)} differ)")
        mine = json.loads((staged / "config.json").read_text())
        theirs = json.loads((Path(self.source) / "config.json").read_text())
        for key in FUNCTION_KEYS:
            if key == "tie_word_embeddings" and theirs[key] and mine.get(key) is False:
                continue  # a family that never ties: the head is written as the embedding's copy (checked)
            if key in theirs and key in mine and theirs[key] != mine[key]:
                raise self._fail(f"config.json sets {key} to {mine[key]!r}, the source has {theirs[key]!r}")

    def _same(self, written: dict[str, str], name: str, expected: str, what: str) -> None:
        got = written.get(name)
        if got is None:
            raise self._fail(f"tensor {name} has no digest in the manifest")
        if got != expected:
            raise self._fail(f"{what}, but its written bytes differ (tensor {name})")

    def _fail(self, why: str) -> UpcyclerError:
        return UpcyclerError(f"{self.what} claims to preserve the function, but the written model does not: "
                             f"{why}; nothing was written; report this, or pass --no-verify to keep such an output "
                             f"(the source was {shown_path(self.source)})")


def _shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    return [(d.name, tuple(d.shape)) for d in declare_params(spec)]


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def _source_digest(tensor: LazyTensor | None, shape: tuple[int, ...], dtype: np.dtype) -> str:
    """The digest a verbatim copy of `tensor` in `dtype` has (zeros of `shape` when the source has none):
    streamed from the source file when it is stored there in that dtype."""
    if tensor is None:
        return tensor_digest(np.zeros(shape, dtype))
    if tensor.stored is not None and np.dtype(tensor.dtype) == dtype:
        return _stored_digest(tensor.stored)
    return tensor_digest(np.asarray(tensor.load()).astype(dtype))


def _stored_digest(stored: StoredBytes) -> str:
    digest = xxhash.xxh3_128()
    with open(stored.path, "rb", buffering=0) as f:
        done = 0
        while done < stored.nbytes:
            piece = os.pread(f.fileno(), min(READ, stored.nbytes - done), stored.offset + done)
            if not piece:
                raise UpcyclerError(f"{shown_path(stored.path)}: ends before the tensor it declares; "
                                    "re-download the source")
            digest.update(piece)
            done += len(piece)
    return digest.hexdigest()


def _rows_digest(tensor: LazyTensor, window, dtype: np.dtype) -> str:
    """Digest of rows `window` of a dense [F, D] tensor in `dtype`."""
    stored = tensor.stored_rows(window) if np.dtype(tensor.dtype) == dtype else None
    if stored is not None:
        return _stored_digest(stored)
    return tensor_digest(np.asarray(_load(tensor)[window]).astype(dtype))


def _down_window(down: np.ndarray, window, scales: np.ndarray, factor: float, cover: Cover,
                 dtype: np.dtype) -> np.ndarray:
    """Columns `window` of the dense down_proj scaled as the transform promises (in `dtype`, rounded once)."""
    cols = np.ascontiguousarray(down[:, window])
    return scale_columns(cols, factor if cover.overlap == 0 else scales, dtype)


def _neurons(window) -> str:
    if isinstance(window, slice):
        return f"neurons {window.start}–{window.stop - 1}"
    return f"neurons {int(window[0])}–{int(window[-1])} (wrapping)"


def _load(tensor: LazyTensor) -> np.ndarray:
    return np.asarray(tensor.load())


def _to_f32(a: np.ndarray) -> np.ndarray:
    """fp32 copy of a bf16/fp16/fp32/fp64 array (bf16 by a bit shift: much faster than a cast)."""
    if a.dtype == BF16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _times(x: np.ndarray, weight: LazyTensor) -> np.ndarray:
    """x @ Wᵀ for a dense [F, D] weight, converted to fp32 `CHUNK` rows at a time."""
    w = _load(weight)
    return np.concatenate([x @ _to_f32(w[s:s + CHUNK]).T for s in range(0, w.shape[0], CHUNK)], axis=1)


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1 + np.exp(-z))


def _route(logits: np.ndarray, kind: str, k: int, scaling: float,
           bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(weights [P, K], experts [P, K]) of the family's router; ties go to the lower expert index."""
    logits = logits.astype(np.float64)
    if kind == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
        select = scores + (0 if bias is None else bias.astype(np.float64))
    else:
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = select = z / z.sum(-1, keepdims=True)
    chosen = np.argsort(-select, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if kind == "renormalized":
        weights = weights / weights.sum(-1, keepdims=True)
    elif kind == "sigmoid":
        weights = weights / weights.sum(-1, keepdims=True) * scaling
    return weights.astype(np.float32), chosen


def write_check_for(plan: Any) -> WriteCheck | None:
    """The in-stream check of a `transforms.pipeline.Plan` that is one exact `dense-to-moe` step (no
    --experts-from, no re-initialised neurons) from a local HF source to a local HF output; None for any
    other plan, which keeps the full check."""
    from upcycler.io import detect_format
    from upcycler.locations import is_remote

    recipe = plan.recipe
    if len(recipe.steps) != 1 or recipe.steps[0].transform.name != "dense-to-moe" or not plan.exact:
        return None
    config = recipe.steps[0].config
    if config.experts_from is not None or config.reinit_ratio > 0 or recipe.output.format != "hf":
        return None
    if is_remote(recipe.source) or is_remote(recipe.output.path) or detect_format(Path(recipe.source)) != "hf":
        return None
    return WriteCheck(Path(recipe.source), config, plan.ckpt.spec)
