"""The reference MoE layer's grouped matmuls on one TPU chip: tokamax against megablox, compiled only.

    python bench/tokamax_gmm.py            # one v5e chip's shard of the reference step: 16,384 tokens,
                                           # D 1792, expert width 1152, 64 experts, top-8, bf16
    python bench/tokamax_gmm.py --quick    # small sizes, seconds
    python bench/tokamax_gmm.py --chip v6e

Needs JAX >= 0.11 with libtpu and tokamax (`pip install 'jax[tpu]' tokamax`, Python >= 3.12); no TPU:
each layer is compiled for one chip of a slice libtpu describes (`train/aot/topology.py`), as the chip runs
it in the reference step (the layer whole on the chip, FSDP-gathered expert weights, its own tokens).

The layer is the project's dropless MoE (`upcycler.train.model.moe`: router, sort by expert, dispatch
gather, grouped matmuls, swiglu, fp32 weighted combine), forward (`fwd`) and forward+backward (`fwd_bwd`:
value and gradient of mean(y²) in x and every weight, router included), with three grouped-matmul paths:

- `megablox` (the baseline): `dropless_moe(backend="megablox")`, the project's own path: JAX's megablox
  `gmm`/`tgmm` kernels with tiles from `gmm_tiles` for the scoped VMEM upcycler gives libtpu (64 MiB).
- `tokamax`: the same layer with each grouped matmul `tokamax.ragged_dot(implementation="mosaic_tpu_v2")`
  (tokamax's gmm_v2 kernel forward and for dx, tgmm_v2 for dW, tiles from tokamax's own VMEM heuristic),
  swiglu as the project computes it.
- `tokamax_fused`: gate/up with `fuse_gateup_activation="silu"`: silu(gate)·up in the kernel's epilogue,
  so [X, 2F] is never written. tokamax has no backward for the fused epilogue, so a custom VJP recomputes
  the unfused gate/up product in the backward pass (one more forward gate/up matmul: +2/9 of the
  layer's matmul FLOPs) and differentiates through it.

Figures per layer and phase, all per chip from the compiled programs (`hbm_traffic`, `roofline`):
- `hbm_bytes`: the project's HBM walk, each Pallas kernel charged at least its own cost estimate.
  The two libraries estimate differently: megablox counts the rows once per column tile and a weight block
  once per row-tile visit (even when the block stays in VMEM between visits), tokamax's gmm_v2/tgmm_v2
  count every operand once, whatever the tiles. Neither counts what the other does, so `hbm_bytes` does not
  compare them fairly. `hbm_bytes_tile_model` charges every kernel of both libraries by one model of what
  its tiles move (`tile_model`), the rest of the program as walked.
- `flops`: analytic (`executed`: the matmuls, router included) and `executed_tile_model`: with the work
  each kernel's row tiles waste at group boundaries (`tile_model`: megablox multiplies a whole row tile on
  each of its ⌈m/tm⌉ + g − 1 visits, tokamax rounds each group's rows up to its 128- or 256-row bucket),
  and XLA's `cost_analysis()` count (which takes the kernels' own estimates: no waste).
- `roofline`: compute, memory and the bound from the tile model's FLOPs and bytes, with the MFU it allows
  (model FLOPs: the layer once, without `tokamax_fused`'s recompute or any waste);
  `roofline_own_estimates`: the project's convention (analytic FLOPs, `hbm_bytes`).
- `kernels`: each grouped-matmul kernel: tiles, own estimate, operands once, the tile model's bytes,
  FLOPs and MXU FLOPs.
- `peak_bytes`: the compiler's peak memory (`compile_report.compiled_peak`), `temp_bytes` its temporaries.
- `vs_megablox`: each tokamax path's figures over megablox's, compiled in the same run.

These are compile-only bounds, not measurements: a kernel is assumed to reach the roofline of its FLOPs and
bytes. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp

from upcycler import hardware
from upcycler.train.aot import hbm_traffic, roofline
from upcycler.train.aot.compile_report import compiled_peak
from upcycler.train.aot.topology import parse_slice, tpu_devices
from upcycler.train.model import moe
from upcycler.train.model.gmm_megablox import scoped_vmem_of
from upcycler.train.model.gmm_tiles import gmm_tiles, tgmm_tiles

VARIANTS = ("megablox", "tokamax", "tokamax_fused")
PHASES = ("fwd", "fwd_bwd")
# tokamax names its kernels after their shapes and tiles: gmm_v2-g_64-m_131072-k_1792-act_silu-n_2304-tm_…
_TOKAMAX_KERNEL = re.compile(r"(t?gmm)_v2-g_(\d+)-m_(\d+)-k_(\d+)-act_(\w+?)-n_(\d+)-tm_(\d+)-tk_(\d+)-tn_(\d+)")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens on the chip (1024 × 4096 / 256)")
    parser.add_argument("--d-model", type=int, default=1792)
    parser.add_argument("--width", type=int, default=1152, help="expert width F")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--router", default="renormalized", choices=moe.ROUTER_KINDS)
    parser.add_argument("--chip", default="v5e", choices=("v5e", "v5p", "v6e"))
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--quick", action="store_true", help="T 2048, D 256, width 256, 16 experts, top-4")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.d_model, args.width, args.experts, args.topk = 2048, 256, 256, 16, 4
    return args


# ------------------------------------------------------------------------------------------- the layers


def _ragged(x, w, group_sizes, fuse: str | None = None):
    import tokamax

    return tokamax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype, implementation="mosaic_tpu_v2",
                              fuse_gateup_activation=fuse)


@jax.custom_vjp
def fused_gate_up(x_XD, w_gate_up_EDU, group_sizes_E):
    """silu(x @ gate) · (x @ up) per group, in the kernel's epilogue: [X, F], the [X, 2F] never written."""
    return _ragged(x_XD, w_gate_up_EDU, group_sizes_E, fuse="silu")


def _fused_fwd(x_XD, w_gate_up_EDU, group_sizes_E):
    return fused_gate_up(x_XD, w_gate_up_EDU, group_sizes_E), (x_XD, w_gate_up_EDU, group_sizes_E)


def _fused_bwd(residuals, g_XF):
    x_XD, w_gate_up_EDU, group_sizes_E = residuals
    h_XU, pull = jax.vjp(lambda x, w: _ragged(x, w, group_sizes_E), x_XD, w_gate_up_EDU)
    (d_h_XU,) = jax.vjp(moe.swiglu, h_XU)[1](g_XF)
    d_x, d_w = pull(d_h_XU)
    return d_x, d_w, None


fused_gate_up.defvjp(_fused_fwd, _fused_bwd)


def tokamax_moe(x_TD, w_gate_up_EDU, w_down_EDF, routing: moe.Routing, *, fused: bool):
    """`moe.dropless_moe` with tokamax's grouped matmuls: the same dispatch, swiglu and combine."""
    t, top_k = routing.expert_Tk.shape
    plan = moe.plan_dispatch(routing.expert_Tk, w_gate_up_EDU.shape[0])
    pos_Tk = plan.pos_C.reshape(t, top_k)
    x_XD = moe.dispatch_rows(x_TD, plan.copy_X, pos_Tk, True)
    if fused:
        a_XF = fused_gate_up(x_XD, w_gate_up_EDU, plan.group_sizes_E)
    else:
        a_XF = moe.swiglu(_ragged(x_XD, w_gate_up_EDU, plan.group_sizes_E))
    y_XD = _ragged(a_XF, jnp.swapaxes(w_down_EDF, 1, 2), plan.group_sizes_E)  # down as stored, swapped, as `gmm` does
    return moe.combine_rows(y_XD, routing.weight_Tk, pos_Tk, plan.copy_X, True).astype(x_TD.dtype)


def layer(variant: str, top_k: int, router: str):
    def fn(x_TD, w_gate_up_EDU, w_down_EDF, w_router_ED):
        routing = moe.route(moe.router_logits(x_TD, w_router_ED), top_k, router)
        if variant == "megablox":
            return moe.dropless_moe(x_TD, w_gate_up_EDU, w_down_EDF, routing, backend="megablox")
        return tokamax_moe(x_TD, w_gate_up_EDU, w_down_EDF, routing, fused=variant == "tokamax_fused")

    return fn


def program(variant: str, phase: str, top_k: int, router: str):
    fn = layer(variant, top_k, router)
    if phase == "fwd":
        return fn

    def loss(*args):
        return jnp.mean(fn(*args).astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


# ---------------------------------------------------------------------------------------------- figures


def analytic_flops(tokens: int, d: int, width: int, experts: int, top_k: int) -> dict[str, float]:
    """Matmul FLOPs of the layer: forward, forward+backward, and the fused path's gate/up recompute."""
    rows = tokens * top_k
    forward = 2 * rows * d * 2 * width + 2 * rows * width * d + 2 * tokens * d * experts  # gate/up, down, router
    return {"fwd": forward, "fwd_bwd": 3 * forward, "recompute": 2 * rows * d * 2 * width}


def tile_model(library: str, kind: str, m: int, k: int, n_out: int, n_weight: int, groups: int,
               tiles: tuple[int, int, int], bucket: int = 128, in_bytes: int = 2,
               out_bytes: int = 2) -> tuple[int, int]:
    """(HBM bytes, MXU FLOPs) of one grouped-matmul kernel with tiles (tm, tk, tn), every one of the m rows
    in one of `groups` groups of uneven sizes. One model for both libraries, whose grids are alike (column
    tiles outermost, then row tiles, the contraction innermost; a block whose index does not change between
    two steps is not fetched again); they differ in the row tiles a group boundary costs:

    - megablox visits a row tile once per group it holds (⌈m/tm⌉ + g − 1 visits when every boundary falls
      inside a tile, as it does for groups of uneven sizes) and multiplies the whole tile on each visit
      (the rows of other groups masked at the store);
    - tokamax's gmm_v2/tgmm_v2 start each group's tiles at its first row, fetch only its rows, and multiply
      them rounded up to `bucket` rows (half a bucket per group wasted on average).

        gmm   rows of x read once per column tile (megablox with a split contraction: whole row tiles on
              every visit) + weights: [g, k, n_weight] once when tk covers k, else [k, n_weight] per visit
              + out [m, n_out]
        tgmm  x [m, k]·⌈n/tn⌉ + dy [m, n]·⌈k/tk⌉ + dW [g, k, n]

    `n_weight` is the weight's width (2·n_out for a fused gate/up epilogue), `tn` counts output columns."""
    tm, tk, tn = tiles
    visits = -(-m // tm) + groups - 1
    rows = visits * tm if library == "megablox" else m + groups * bucket // 2
    flops = 2 * rows * k * n_weight
    if kind == "tgmm":
        traffic = m * k * in_bytes * -(-n_out // tn) + m * n_out * in_bytes * -(-k // tk) + groups * k * n_out * out_bytes
        return traffic, flops
    lhs_rows = visits * tm if library == "megablox" and tk < k else m
    weights = groups * k * n_weight if tk >= k else k * n_weight * visits
    return lhs_rows * k * in_bytes * -(-n_out // tn) + weights * in_bytes + m * n_out * out_bytes, flops


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(s) for s in m.group(1).split(",") if s) for m in _ARRAY.finditer(text)]


def kernel_figures(charge: hbm_traffic.Charge, vmem: int) -> dict:
    """One kernel: which, its tiles (tokamax: from its name; megablox: `gmm_tiles`/`tgmm_tiles` for its shape,
    as `gmm_megablox` chooses them), its own estimate, operands once, its FLOPs and the tile model's bytes
    and MXU FLOPs."""
    instr = charge.instr
    row = {"kernel": None, "runs": charge.runs, "estimate": charge.estimate, "operands_once": charge.operand_bytes,
           "charged": charge.bytes}
    found = _TOKAMAX_KERNEL.search(instr.name) or _TOKAMAX_KERNEL.search(instr.op_name)
    if found:
        kind, g, m, k, act, n, tm, tk, tn = found.groups()
        g, m, k, n, tiles = int(g), int(m), int(k), int(n), (int(tm), int(tk), int(tn))
        n_out = n // 2 if act != "None" else n
        bucket = re.search(r'"tiles\.bucket_base":(\d+)', instr.attrs + instr.backend_config)
        library, name, n_weight = "tokamax", f"{kind}_v2" + ("" if act == "None" else f" +{act}"), n
    else:
        traced = re.findall(r"jit\((\w+)\)", instr.op_name.rsplit("/pallas_call", 1)[0])
        name = kind = traced[-1] if traced else instr.name
        out = _shapes(instr.shape)[0]
        operands = [s for s in _shapes(instr.attrs.split("operand_layout_constraints=", 1)[-1].split("}}", 1)[0])
                    if len(s) >= 2]
        if kind == "tgmm" and len(out) == 3:
            g, k, n = out
            m = max(max(s) for s in operands if len(s) == 2)
            tiles = tuple(tgmm_tiles(m, k, n, g, in_bytes=2, out_bytes=2, vmem=vmem))
        elif kind == "gmm" and len(out) == 2:
            m, n = out
            g, a, b = next(s for s in operands if len(s) == 3)
            k = a if b == n else b  # the weights [g, k, n], or [g, n, k] for dx
            tiles = tuple(gmm_tiles(m, k, n, g, in_bytes=2, out_bytes=2, vmem=vmem))
        else:
            row["kernel"] = name
            return row
        library, n_out, n_weight, bucket = "megablox", n, n, None
    traffic, mxu_flops = tile_model(library, kind, m, k, n_out, n_weight, g, tiles,
                                    bucket=int(bucket.group(1)) if bucket else 128)
    row.update(kernel=f"{library} {name}", m=m, k=k, n=n_out, groups=g, tiles=tiles, tile_model=traffic,
               flops=2 * m * k * n_weight, mxu_flops=mxu_flops)
    return row


def one_line_kernels(text: str) -> str:
    """The HLO text with each Pallas kernel's instruction on one line: JAX 0.12 prints a kernel's
    `kernel_metadata` over several lines, with the backend config (and its cost estimate) after them."""
    return re.sub(r"kernel_metadata=\{\n(.*?)\n\}\}", lambda m: "kernel_metadata={" + m.group(1).replace("\n", " ")
                  + "}}", text, flags=re.DOTALL)


def figures(compiled, chip: hardware.Chip, vmem: int, model_flops: float, executed_flops: float) -> dict:
    """The figures of one compiled layer (see the module docstring)."""
    text = compiled.as_text()
    in_text = len(re.findall(r'"cost_estimate"', text))
    charges = list(hbm_traffic.charges(text))
    reader = "as printed"
    if sum(c.estimate is not None for c in charges if c.is_kernel) < in_text:
        text = one_line_kernels(text)  # the walk missed estimates printed past a multi-line kernel
        charges = list(hbm_traffic.charges(text))
        reader = "kernels joined on one line"
    walked = float(sum(c.total for c in charges))
    kernels = [kernel_figures(c, vmem) for c in charges if c.is_kernel]
    charged_kernels = sum(c.total for c in charges if c.is_kernel)
    modelled = sum(k["runs"] * k.get("tile_model", k["charged"]) for k in kernels)
    by_model = walked - charged_kernels + modelled
    waste = sum(k["runs"] * (k["mxu_flops"] - k["flops"]) for k in kernels if "flops" in k)
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    stats = compiled.memory_analysis()
    analytic = roofline.estimate(model_flops, executed_flops, walked, 0.0, chip)
    line = roofline.estimate(model_flops, executed_flops + waste, by_model, 0.0, chip)
    return {
        "hbm_bytes": walked, "hbm_bytes_tile_model": by_model, "kernel_bytes": charged_kernels,
        "kernel_bytes_tile_model": modelled, "outside_kernels_bytes": walked - charged_kernels,
        "bytes_by_xla": float(cost.get("bytes accessed", 0.0)),
        "flops": {"model": model_flops, "executed": executed_flops, "executed_tile_model": executed_flops + waste,
                  "by_xla": float(cost.get("flops", 0.0))},
        "roofline": {"compute_s": line.compute_s, "memory_s": line.memory_s, "step_s": line.step_s,
                     "bound": line.bound, "mfu": line.mfu},
        "roofline_own_estimates": {"compute_s": analytic.compute_s, "memory_s": analytic.memory_s,
                                   "step_s": analytic.step_s, "bound": analytic.bound, "mfu": analytic.mfu},
        "peak_bytes": compiled_peak(compiled), "temp_bytes": int(stats.temp_size_in_bytes),
        "kernels": kernels, "kernel_estimates_in_text": in_text,
        "kernels_with_estimate_read": sum(k["estimate"] is not None for k in kernels), "reader": reader,
    }


def compile_for(fn, shapes, mesh):
    import tokamax
    from jax.sharding import NamedSharding, PartitionSpec

    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, PartitionSpec())) for s, d in shapes]
    start = time.perf_counter()
    # cross_compile: tokamax otherwise checks the host's devices (a CPU here) before tracing its TPU kernels
    with jax.set_mesh(mesh), tokamax.config.cross_compile(True):
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    major, minor = (int(p) for p in jax.__version__.split(".")[:2])
    if (major, minor) < (0, 11):
        raise SystemExit(f"tokamax's TPU kernels need JAX >= 0.11, this is {jax.__version__}")
    import tokamax
    from jax.sharding import Mesh

    T, D, F, E, K = args.tokens, args.d_model, args.width, args.experts, args.topk
    devices = tpu_devices(parse_slice(f"{args.chip}-{8 if args.chip == 'v5p' else 4}"))
    mesh = Mesh(devices[:1], ("chip",))
    chip = hardware.for_devices(devices)
    vmem = scoped_vmem_of(chip)
    shapes = [((T, D), jnp.bfloat16), ((E, D, 2 * F), jnp.bfloat16), ((E, D, F), jnp.bfloat16),
              ((E, D), jnp.float32)]
    flops = analytic_flops(T, D, F, E, K)
    results: dict[str, dict] = {}
    for phase in args.phases:
        for variant in VARIANTS:
            compiled, seconds = compile_for(program(variant, phase, K, args.router), shapes, mesh)
            executed = flops[phase] + (flops["recompute"] if variant == "tokamax_fused" and phase == "fwd_bwd" else 0)
            line = figures(compiled, chip, vmem, flops[phase], executed)
            line["compile_seconds"] = round(seconds, 1)
            results.setdefault(variant, {})[phase] = line

    def ratio(variant: str, phase: str, get) -> float:
        return round(get(results[variant][phase]) / get(results["megablox"][phase]), 4)

    measures = {"hbm_bytes": lambda r: r["hbm_bytes"], "hbm_bytes_tile_model": lambda r: r["hbm_bytes_tile_model"],
                "kernel_bytes_tile_model": lambda r: r["kernel_bytes_tile_model"],
                "compute_s": lambda r: r["roofline"]["compute_s"], "step_s": lambda r: r["roofline"]["step_s"],
                "step_s_own_estimates": lambda r: r["roofline_own_estimates"]["step_s"],
                "peak_bytes": lambda r: r["peak_bytes"]}
    vs = {v: {p: {name: ratio(v, p, get) for name, get in measures.items()} for p in args.phases}
          for v in VARIANTS[1:]}
    config = {"tokens": T, "d_model": D, "width": F, "experts": E, "topk": K, "rows": T * K, "router": args.router,
              "dtype": "bfloat16", "chip": chip.name, "megablox_scoped_vmem": vmem, "jax": jax.__version__,
              "tokamax": tokamax.__version__}
    print(json.dumps({"bench": "tokamax_gmm", "config": config, "baseline": "megablox", "layers": results,
                      "vs_megablox": vs}))


if __name__ == "__main__":
    main()
