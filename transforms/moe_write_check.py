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

Cost: one read of the source's bytes from the page cache, an xxh3 pass over them, and P × the dense MLP's
FLOPs per layer (P = the number of virtual groups, at least `MIN_PROBES`); memory: a few MiB at any model
size, the MLP being streamed a chunk of rows at a time (`moe_block_stream`).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from threadpoolctl import threadpool_limits

from upcycler.errors import UpcyclerError
from upcycler.families import Family, family_named
from upcycler.io.hashing import tensor_digest
from upcycler.io.hf_read import read_hf, read_spec
from upcycler.io.manifest import read_manifest
from upcycler.layout import declare_params, layer_prefix
from upcycler.spec import ModelSpec
from upcycler.tensors import LazyTensor, StoredBytes, TensorMap
from upcycler.transforms.dense_to_moe import DenseToMoE, cover_for, router_factor
from upcycler.transforms.expert_cover import Cover
from upcycler.transforms.moe_block_stream import Buffers, LayerSums, column_window_digests, row_window_digests
from upcycler.transforms.pipeline import Plan
from upcycler.untrusted import shown_path

NOISE_FACTOR = 10.0  # the MoE block may differ from the dense MLP by this many times the layer's own floor
FP32_ULP = 2.0**-23
MIN_PROBES = 8  # probe vectors per layer at least (one per virtual group when there are more groups)
READ = 8 << 20  # bytes hashed at a time when a source tensor is streamed from its file
PACE_TIMEOUT = 600.0  # seconds the check waits for the writer to move on before reading ahead anyway
# settings of an HF config that decide the function; each the source has must reach the output unchanged
FUNCTION_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
                 "tie_word_embeddings", "hidden_act", "attention_bias", "max_position_embeddings",
                 "sliding_window", "attention_dropout")


@dataclass(frozen=True)
class _Expected:
    """One written tensor's expected digest, and what it should hold (for the error)."""

    name: str  # the HF name
    digest: str
    what: str


class WriteCheck:
    """The in-stream check of one exact `dense-to-moe` write from `source` to `spec`: `begin()` when the write
    starts computes what every tensor must hold from the source (on a thread, beside the write); calling it
    on the staged output compares that with the digests the writer recorded, and reads only config.json
    and the manifest of the output."""

    what = "dense-to-moe"

    def __init__(self, source: Path, config: DenseToMoE, spec: ModelSpec, planned: TensorMap):
        self.source, self.config, self.spec = Path(source), config, spec
        self._planned = planned  # the plan's lazy tensors: the routers, produced from their seed
        self._out_dtype = np.dtype(planned["embed"].dtype)
        self._result: Future | None = None
        self._buffers = Buffers()  # the streamed layers' scratch, reused
        self._front = -1  # the deepest layer the writer has reached
        self._finished = False  # the write is over (or never started)
        self._pace = threading.Condition()

    def begin(self) -> None:
        """Start computing the expectations beside the write (idempotent), on a daemon thread that follows
        the writer layer by layer (`written`), so it reads each layer's source bytes while the writer's read
        of them is still in the page cache."""
        if self._result is None:
            self._result = Future()
            threading.Thread(target=self._run, name="write-check", daemon=True).start()

    def written(self, name: str) -> None:
        """The writer has written tensor `name` (an HF name)."""
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) > self._front:
            with self._pace:
                self._front = int(parts[2])
                self._pace.notify_all()

    def _after_writer(self, layer: int) -> None:
        """Wait until the writer is past `layer` or done (at most `PACE_TIMEOUT` seconds)."""
        with self._pace:
            self._pace.wait_for(lambda: self._front > layer or self._finished, timeout=PACE_TIMEOUT)

    def __call__(self, staged: Path) -> dict[str, Any]:
        with self._pace:
            self._finished = True
            self._pace.notify_all()
        self.begin()
        assert self._result is not None
        expected, probes, worst = self._result.result()  # raises what the source side found
        self._check_config(staged)
        written = read_manifest(staged).tensor_xxh3()
        for want in expected:
            got = written.get(want.name)
            if got is None:
                raise self._fail(f"tensor {want.name} has no digest in the manifest")
            if got != want.digest:
                raise self._fail(f"{want.what}, but its written bytes differ (tensor {want.name})")
        for failure in probes:
            raise self._fail(failure)
        groups = self.spec.moe.num_experts // cover_for(self.config, read_spec(self.source)).group  # type: ignore[union-attr]
        count, layers = max(groups, MIN_PROBES), len(self.spec.moe_layers)
        line = (f"same function: every tensor holds the bytes it should ({len(expected):,} by digest as "
                f"written), and each of the {layers} MoE blocks gives its dense MLP's output on {count} probes "
                f"aimed at its {groups} virtual groups within {NOISE_FACTOR:g} × its fp32 noise floor "
                f"(worst: layer {worst[1]}, {worst[0]:.2g} × the floor); config.json has the source's settings")
        return {"method": "in-stream", "against": self.source.name, "tensors_by_digest": len(expected),
                "moe_layers": layers, "probes_per_layer": count, "worst_floor_ratio": worst[0],
                "allowed_floor_ratio": NOISE_FACTOR, "passed": True, "verdict": line}

    def _run(self) -> None:
        assert self._result is not None
        try:
            self._result.set_result(self._expectations())
        except BaseException as err:  # noqa: BLE001 (handed to the caller of the check, raised there)
            self._result.set_exception(err)

    def _expectations(self) -> tuple[list[_Expected], list[str], tuple[float, int]]:
        """(every tensor's expected digest; each failed probe's message; the worst probe's (floor ratio,
        layer)), from the source alone. BLAS on one thread: its idle threads spin, taking the cores the
        writer and its digests need."""
        with threadpool_limits(limits=1, user_api="blas"):
            return self._expect_all()

    def _expect_all(self) -> tuple[list[_Expected], list[str], tuple[float, int]]:
        source = read_hf(self.source, watched=False)  # the write's own read of it checks its manifest
        family = family_named(self.spec.family)
        cover = cover_for(self.config, source.spec)
        moe_layers = set(self.spec.moe_layers)
        expected: list[_Expected] = []
        failures: list[str] = []
        worst: tuple[float, int] = (0.0, -1)
        decls = sorted(declare_params(self.spec), key=lambda d: _order(d.name, self.spec.num_layers))
        block_done: set[int] = set()
        for decl in decls:  # embedding, then layer by layer behind the writer, then the final norm and head
            layer = _layer_of(decl.name)
            if layer is None and decl.name != "embed":
                self._after_writer(self.spec.num_layers)
            elif layer is not None:
                self._after_writer(layer)
            if layer in moe_layers and ".moe." in decl.name:
                if layer not in block_done:  # the block's tensors, together
                    block_done.add(layer)
                    ratio, failure = self._block(layer, cover, source.tensors, family, expected)
                    if failure:
                        failures.append(failure)
                    worst = max(worst, (ratio, layer))
                continue
            parent = source.tensors.get(decl.name)
            if parent is None and decl.name == "lm_head" and source.spec.tie_embeddings:
                parent = source.tensors["embed"]  # untied in a family that never ties: a copy of the embedding
            where = "" if layer is None else f"layer {layer}: "
            dtype = np.dtype(np.float32) if decl.is_buffer and parent is None else self._out_dtype
            expected.append(_Expected(family.hf_names(decl)[0], _source_digest(parent, decl.shape, dtype),
                                      f"{where}{decl.name} should hold the source's tensor" if parent is not None
                                      else f"{where}{decl.name} should be zeros"))
        return expected, failures, worst

    # --- one MoE block ------------------------------------------------------------------------------------
    def _block(self, i: int, cover: Cover, source: TensorMap, family: Family,
               expected: list[_Expected]) -> tuple[float, str | None]:
        """Append what every tensor of MoE layer `i` must hold to `expected`; probe the block against the
        dense MLP. Returns (its largest difference in units of its noise floor, the failure or None)."""
        moe = self.spec.moe
        assert moe is not None
        p = layer_prefix(i)
        R, N = cover.group, moe.num_experts
        out_dtype = self._out_dtype
        factor = router_factor(moe, R)
        names = {d.name: (family.hf_names(d), d) for d in declare_params(self.spec) if d.name.startswith(p + "moe.")}
        scales = [factor if cover.overlap == 0 else cover.column_scales(j, factor) for j in range(R)]
        router = np.asarray(self._planned[p + "moe.router"].load())
        x = _probes(i, router.astype(np.float32), N // R, R)
        by_window: dict[str, list[str]] = {}
        shared_digests: dict[str, str] = {}
        hidden = []
        for w in ("gate_proj", "up_proj"):  # each distinct window once; every member e with e mod R = j holds j's
            values, by_window[w], shared_digests[w] = row_window_digests(source[p + f"mlp.{w}"], x, cover,
                                                                         out_dtype, self._buffers)
            hidden.append(values)
        h = _silu(hidden[0]) * hidden[1]  # [P, F]
        down = source[p + "mlp.down_proj"]  # [D, F]
        double = 2.0 if moe.shared_gated else 1.0
        sums, by_window["down_proj"], shared_digests["down_proj"] = column_window_digests(
            down, h, cover, scales, double, _scaled_dtype(np.dtype(down.dtype), out_dtype), out_dtype, self._buffers)
        if not cover.shared:
            shared_digests = {}
        for w in ("gate_proj", "up_proj", "down_proj"):  # in the order the writer writes them
            hf = names[p + f"moe.experts.{w}"][0]
            for e in range(N):
                expected.append(_Expected(hf[e], by_window[w][e % R], f"layer {i}: routed expert {e}'s {w} should "
                                          f"hold {_neurons(cover.window(e % R))} of the dense {w}"
                                          + (" scaled" if w == "down_proj" else "")))
        for w, digest in shared_digests.items():
            expected.append(_Expected(names[p + f"moe.shared.{w}"][0][0], digest,
                                      f"layer {i}: the shared expert's {w} should hold the first {cover.shared} "
                                      f"neurons of the dense {w}"
                                      + (" doubled (its gate gives 1/2)" if double != 1 and w == "down_proj" else "")))
        expected.append(_Expected(names[p + "moe.router"][0][0], tensor_digest(router.astype(out_dtype)),
                                  f"layer {i}: the router should hold the rows drawn for it"))
        handled = {p + f"moe.{part}.{w}" for part in ("experts", "shared") for w in ("gate_proj", "up_proj", "down_proj")}
        for name, (hf, decl) in names.items():  # what the family adds to the block: zeros
            if name not in handled | {p + "moe.router"}:
                dtype = np.float32 if decl.is_buffer else out_dtype
                expected.append(_Expected(hf[0], tensor_digest(np.zeros(decl.shape, dtype)),
                                          f"layer {i}: {name} should be zeros"))
        router = router.astype(np.float32)
        for g in range(N // R):
            rows = router[g * R:(g + 1) * R]
            if not (rows == rows[0]).all():
                return 0.0, (f"layer {i}: the router rows of virtual group {g} (experts {g * R}–{(g + 1) * R - 1}) "
                             "differ, so top-k can split the group")
        return self._probe(i, cover, x, sums, router, scales, double)

    def _probe(self, i: int, cover: Cover, x: np.ndarray, sums: LayerSums, router: np.ndarray,
               scales: list, double: float) -> tuple[float, str | None]:
        """The MoE block from the windows and the router against the dense MLP on probes aimed at every
        virtual group: (the largest difference in units of the floor, the failure past `NOISE_FACTOR` or
        None). A shared expert's gate and a router bias are zeros (their digests are checked)."""
        moe = self.spec.moe
        assert moe is not None
        R, K = cover.group, moe.top_k
        probes = len(x)
        want, reordered = np.zeros_like(sums.partial[0]), np.zeros_like(sums.partial[0])
        for forward, backward in zip(sums.partial, sums.partial[::-1]):  # the same sum in two orders
            want += forward
            reordered += backward
        # a block that adds nothing (down_proj all zeros, as `upcycle depth` grows them) has no noise at all:
        # its MoE must add exactly nothing too, measured against the smallest normal fp32
        floor = max(float(np.abs(reordered - want).max()), FP32_ULP * float(np.abs(want).max()),
                    float(np.finfo(np.float32).tiny))
        if sums.window_parts is None:  # tiled windows are runs of whole pieces, each with one scale
            owner = [next((j for j in range(R) if _inside(n, cover.window(j))), -1) for n in sums.pieces]
            parts = [np.float32(scales[j]) * sum((sums.partial[q] for q, o in enumerate(owner) if o == j),
                                                 np.zeros_like(want)) for j in range(R)]
        else:
            parts = sums.window_parts
        shared = sum((sums.partial[q] for q, n in enumerate(sums.pieces) if n.stop <= cover.shared),
                     np.zeros_like(want))
        weights, chosen = _route(x @ router.T, moe.router, K, moe.routed_scaling_factor)
        got = np.zeros_like(want)
        for k in range(K):
            e = chosen[:, k]
            got += weights[:, k:k + 1] * np.stack([parts[j][n] for n, j in enumerate(e % R)])
        if cover.shared:
            shared = shared * np.float32(double)
            got += shared / 2 if moe.shared_gated else shared  # sigmoid(0 · x) = 1/2
        worst = float(np.abs(got - want).max())
        if not worst <= NOISE_FACTOR * floor:
            return worst / floor, (f"layer {i}: the MoE block's output differs from the dense MLP's by {worst:.2e} "
                                   f"> {NOISE_FACTOR:g} × its fp32 noise floor {floor:.1e} on {probes} probes "
                                   "aimed at its virtual groups")
        return worst / floor, None

    # --- helpers ------------------------------------------------------------------------------------------
    def _check_config(self, staged: Path) -> None:
        """config.json reads back as the planned spec and keeps the source's function settings."""
        got = read_spec(staged)
        differ = self.spec.differences(got)
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

    def _fail(self, why: str) -> UpcyclerError:
        return UpcyclerError(f"{self.what} claims to preserve the function, but the written model does not: "
                             f"{why}; nothing was written; report this, or pass --no-verify to keep such an output "
                             f"(the source was {shown_path(self.source)})")


def _scaled_dtype(source: np.dtype, output: np.dtype) -> np.dtype:
    """The dtype the transform scales routed down_proj in: the source's, or the output's where wider."""
    return np.dtype(output) if np.dtype(output).itemsize > np.dtype(source).itemsize else np.dtype(source)


def _shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    return [(d.name, tuple(d.shape)) for d in declare_params(spec)]


def _order(name: str, layers: int) -> int:
    """Where the writer is when it writes canonical tensor `name`: the embedding first, the final norm and
    the head last."""
    layer = _layer_of(name)
    return -1 if name == "embed" else layers if layer is None else layer


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
    """The digest of a tensor's stored bytes, read `READ` bytes at a time into one buffer."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(min(READ, stored.nbytes))
    with open(stored.path, "rb", buffering=0) as f:
        done = 0
        while done < stored.nbytes:
            piece = memoryview(buffer)[:min(READ, stored.nbytes - done)]
            got = os.preadv(f.fileno(), [piece], stored.offset + done)
            if not got:
                raise UpcyclerError(f"{shown_path(stored.path)}: ends before the tensor it declares; "
                                    "re-download the source")
            digest.update(piece[:got])
            done += got
    return digest.hexdigest()


def _neurons(window) -> str:
    if isinstance(window, slice):
        return f"neurons {window.start}–{window.stop - 1}"
    return f"neurons {int(window[0])}–{int(window[-1])} (wrapping)"


def _probes(layer: int, router: np.ndarray, groups: int, R: int) -> np.ndarray:
    """[P, D] fp32 probe inputs, P = max(groups, MIN_PROBES): probe g aimed at virtual group g's router row
    (its logit then tops the others'), the rest (and all, for a zero router) N(0, 1)."""
    D = router.shape[1]
    x = np.random.default_rng([layer, 7]).standard_normal((max(groups, MIN_PROBES), D)).astype(np.float32)
    for g in range(groups):
        row = router[g * R]
        norm = float(np.linalg.norm(row))
        if norm > 0:
            x[g] = 0.5 * x[g] + row * (4.0 * np.sqrt(D) / norm)
    return x


def _inside(piece: slice, window: slice) -> bool:
    return window.start <= piece.start and piece.stop <= window.stop


def _silu(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(−z) = inf for very negative z gives z / inf = −0, the limit
        return z / (1 + np.exp(-z))


def _route(logits: np.ndarray, kind: str, k: int, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """(weights [P, K], experts [P, K]) of the family's router (a router bias, GLM's selection-only
    correction, is zero after an upcycle); ties go to the lower expert index."""
    logits = logits.astype(np.float64)
    if kind == "sigmoid":
        scores = select = 1 / (1 + np.exp(-logits))
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


def write_check_for(plan: Plan) -> WriteCheck | None:
    """The in-stream check of `plan` when it is one exact `dense-to-moe` step (no --experts-from, no
    re-initialised neurons) from a local HF source to a local HF output; None for any other plan, which keeps
    the full check."""
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
    return WriteCheck(Path(recipe.source), config, plan.ckpt.spec, plan.ckpt.tensors)
