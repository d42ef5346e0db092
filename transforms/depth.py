"""`depth`: grow a model's depth by copying decoder layers (LLaMA-Pro identity blocks, SOLAR, interleaving).

The result is described by a *layer map*: the source layer of every output layer. Three built-in maps,
or an explicit `--layer-map 0-23,8-31` (inclusive ranges). The lineage step records the map and the new
layers (every output layer but a source layer's first occurrence) as `layer_map` and `new_layers`:

    identity    LLaMA-Pro block expansion: the L − n copies are spread evenly (for 32 → 40, one after
                every 4th layer) and each copy has o_proj and down_proj (every routed expert's and the
                shared expert's too) and their biases zeroed, so it adds nothing to the residual stream
    solar       SOLAR depth up-scaling: two copies with the overlap removed, n → L = 2(n − m):
                layers 0..n−m−1 then m..n−1 (32 → 48 is 0..23 then 8..31)
    interleave  the layers the identity map would copy, each followed by an unmodified copy

Per-layer config lists follow their layer: `layer_types` (sliding-window layers) and `dense_layers`
(dense MLPs of an MoE model). Every tensor of an output layer is the source layer's lazy tensor (or
lazy zeros), so nothing is read until written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec, within_limit
from upcycler.tensors import LazyTensor, TensorMap, zeros
from upcycler.transforms.registry import TransformContext, option, record, register, report
from upcycler.untrusted import describe

# Residual-stream writers of a layer: zeroed in an identity block.
ZEROED = ("attn.o_proj", "attn.o_bias", "mlp.down_proj", "mlp.down_bias", "moe.experts.down_proj",
          "moe.shared.down_proj")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_RANGE = re.compile(r"^\s*(\d{1,9})\s*(?:-\s*(\d{1,9})\s*)?$")  # no layer index has more digits


@dataclass(frozen=True)
class Depth:
    """Options of `depth`."""

    layers: int | None = option(None, help="Layers of the result (default: the length of --layer-map).",
                                metavar="L")
    method: str = option("identity", choices=("identity", "solar", "interleave"),
                         help="identity: zero-initialised copies (exact); solar: two overlapping stacks; "
                              "interleave: each copied layer followed by its copy.")
    layer_map: str | None = option(None, help="Source layer of every output layer, as inclusive ranges, "
                                              "e.g. 0-23,8-31 (identity zeroes repeated layers).", metavar="MAP")


@register("depth", Depth)
def depth(cfg: Depth, spec: ModelSpec, tensors: TensorMap,
          context: TransformContext) -> tuple[ModelSpec, TensorMap]:
    """Grow the number of decoder layers by copying layers, on dense and MoE models alike.

    identity: LLaMA Pro block expansion (Wu et al., arXiv 2401.02415); preserves the function exactly,
    because a copy whose o_proj and down_proj (and biases) are zero is the identity on the residual
    stream. solar and interleave: SOLAR depth up-scaling (Kim et al., arXiv 2312.15166) and plain
    duplication; by design they do NOT preserve the function (layers run twice) and are reported so.
    Embeddings, norms and every copied tensor are the source's, bit for bit.
    """
    n = spec.num_layers
    layer_map = _layer_map(cfg, n)
    added = new_layers(layer_map)
    copies = set(added) if cfg.method == "identity" else set()  # identity zeroes exactly the new layers
    zeroed = [j in copies for j in range(len(layer_map))]
    by_layer: dict[int, dict[str, LazyTensor]] = {i: {} for i in range(n)}
    others: dict[str, LazyTensor] = {}
    for name, tensor in tensors.items():
        m = _LAYER.match(name)
        if m:
            by_layer[int(m.group(1))][m.group(2)] = tensor
        else:
            others[name] = tensor
    out: dict[str, LazyTensor] = dict(others)
    for j, (s, zero) in enumerate(zip(layer_map, zeroed)):
        for suffix, tensor in by_layer[s].items():
            out[f"layers.{j}.{suffix}"] = zeros(tensor.shape, tensor.dtype) if zero and suffix in ZEROED else tensor
    dense = set(spec.dense_layers)
    new_spec = spec.replace(
        num_layers=len(layer_map),
        layer_types=None if spec.layer_types is None else tuple(spec.layer_types[s] for s in layer_map),
        dense_layers=tuple(j for j, s in enumerate(layer_map) if s in dense),
    )
    _report(cfg.method, layer_map, zeroed, n)
    record(layer_map=list(layer_map), new_layers=added)
    return new_spec, TensorMap(out)


def new_layers(layer_map: list[int]) -> list[int]:
    """The inserted layers of a layer map: every output layer that is not its source's first occurrence
    (for identity exactly the zeroed copies). Recorded in the lineage step (`upcycler.io.manifest.new_layers`
    reads them back, e.g. for `optimizer.trainable: new_layers`)."""
    seen: set[int] = set()
    out = []
    for j, s in enumerate(layer_map):
        if s in seen:
            out.append(j)
        seen.add(s)
    return out


def _layer_map(cfg: Depth, n: int) -> list[int]:
    """The source layer of every output layer, from --layer-map or the method's default map.

    --layers is checked against the layer limit before any map is built, so a huge value fails at once."""
    if cfg.layers is not None:
        within_limit(cfg.layers, "num_layers", "--layers")
    if cfg.layer_map is not None:
        layer_map = parse_layer_map(cfg.layer_map, n)
        if cfg.layers is not None and cfg.layers != len(layer_map):
            raise UpcyclerError(f"--layer-map has {len(layer_map)} layers but --layers is {cfg.layers}; "
                                "drop --layers or make them agree")
    elif cfg.layers is None:
        raise UpcyclerError("depth needs --layers L or --layer-map")
    elif cfg.method == "solar":
        layer_map = solar_map(n, cfg.layers)
    else:
        layer_map = spread_map(n, cfg.layers)
    if len(layer_map) < n:
        raise UpcyclerError(f"--layers {len(layer_map)} is below the source's {n} layers; depth only grows a model")
    return layer_map


def spread_map(n: int, layers: int) -> list[int]:
    """Each source layer followed by its copies, the L − n copies spread evenly (after every n/(L−n)-th layer)."""
    if layers < n:
        raise UpcyclerError(f"--layers {layers} is below the source's {n} layers; depth only grows a model")
    extra = layers - n
    out = []
    for i in range(n):
        copies = (i + 1) * extra // n - i * extra // n
        out += [i] * (1 + copies)
    return out


def solar_map(n: int, layers: int) -> list[int]:
    """SOLAR: layers 0..n−m−1 then m..n−1, with overlap m = n − L/2 (32 → 48: 0..23 then 8..31)."""
    if layers < n:
        raise UpcyclerError(f"--layers {layers} is below the source's {n} layers; depth only grows a model")
    if layers % 2 or layers > 2 * n:
        raise UpcyclerError(f"--method solar needs an even --layers between {n} and {2 * n} (two copies of the "
                            f"{n} layers with an overlap removed); use --layer-map for other shapes")
    m = n - layers // 2
    return list(range(n - m)) + list(range(m, n))


def parse_layer_map(text: str, n: int) -> list[int]:
    """'0-23,8-31' → [0, …, 23, 8, …, 31]; every index must be a layer of the source."""
    out: list[int] = []
    for part in text.split(","):
        m = _RANGE.match(part)
        if not m:
            raise UpcyclerError(f"--layer-map {describe(text)}: {describe(part)} is not a layer or an "
                                "inclusive range like 8-31")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if lo > hi or hi >= n:
            raise UpcyclerError(f"--layer-map {describe(text)}: range {describe(part.strip())} is not within "
                                f"layers 0..{n - 1}")
        within_limit(len(out) + hi + 1 - lo, "num_layers", "--layer-map length")
        out += range(lo, hi + 1)
    return out


def format_layer_map(layer_map: list[int]) -> str:
    """The inverse of `parse_layer_map`: runs of consecutive layers as ranges."""
    runs: list[list[int]] = []
    for s in layer_map:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _report(method: str, layer_map: list[int], zeroed: list[bool], n: int) -> None:
    kept = [s for s, z in zip(layer_map, zeroed) if not z]
    text = f"{method}: {n} → {len(layer_map)} layers, layer map {format_layer_map(layer_map)}"
    if kept == list(range(n)):
        report(f"{text}; {sum(zeroed)} identity blocks (o_proj and down_proj zeroed): function-preserving")
    else:
        report(f"NOT function-preserving (by design): {text}", exact=False)
