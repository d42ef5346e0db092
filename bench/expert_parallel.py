"""Benchmark the expert-parallel MoE dispatch: collective traffic on a TPU pod, time and error on CPU.

`model.moe_dispatch` is compared with GSPMD twice: the collective traffic of the reference workload
compiled for a TPU pod, and the layer's time and error on this host's CPU devices.

    python bench/expert_parallel.py                          # both parts: mesh.expert 8, bf16 payloads
    python bench/expert_parallel.py --full                   # mesh.expert 8 and 16, every payload
    python bench/expert_parallel.py --only compile --topology v5p-256   # ragged all-to-all
    python bench/expert_parallel.py --only compile --microbatches 2     # EP at another microbatch count
    python bench/expert_parallel.py --only cpu --repeats 5

A TPU compile of the workload takes 1 to 2.5 minutes on a two-core host: about 10 minutes for the default
run (4 compiles and the CPU part), 30 for `--full` (22 compiles, the 4 that run out of memory fail fast).

Compile part (needs `[tpu]`). The reference workload (`bench/configs/moe-13b-a2b-v5e-256.yaml`: 64 experts,
top-8, D 1792, F 1152, 32 layers, 1024 × 4096 tokens per step) is compiled for `--topology` through
`upcycler.train.aot.compile.compile_only` with `mesh.expert` n (fsdp the rest) for each dispatch:

- `gspmd`, the baseline compiled in the same run: every device all-gathers every expert's weights. Compiled
  at its own `data.microbatches` 1 and at the expert-parallel variants' count.
- `all_to_all` and `all_gather` with `model.comm_dtype` bf16 (`--full`: fp32, bf16 and fp8), at
  `--microbatches` 4: at 1 their dropless buffers (n·T·min(k, E/n) rows per device) exceed a v5e's HBM
  (`--full` compiles them at 1 too, to show it). On TPU v5e the all_to_all variant is a padded
  `lax.all_to_all` (libtpu refuses `ragged_all_to_all` under v5e's limited ICI routing), which moves
  n·T·min(k, E/n) rows per exchange instead of the T·k that exist; v5p compiles the ragged one.
- `--full` adds, per mesh, the variant with the least traffic again with `model.grad_comm_dtype` bf16.

One JSON line per compile: fit, peak and memory by category, collective traffic per device per step by
kind, its total and where it comes from (`moe_layer`: ops traced inside the MoE layer's per-device code,
its weight gathers included; `rest`: the other named ops; `unnamed`: ops XLA made or merged, which lose
their source, such as the gspmd path's expert-gradient all-reduce at mesh.expert 8: `moe_layer` is a lower
bound of the MoE's share), the roofline step time and MFU bound, and the ratio of the total to gspmd's at
the same mesh and microbatches (`traffic_vs_gspmd`) and at gspmd's own microbatches 1
(`traffic_vs_gspmd_mb1`). A last line per run sums up each mesh: the variant with the least traffic and
its cut against both gspmd baselines.

Traffic is read from the compiled HLO with `upcycler.train.aot.collectives` (each collective once, loops
unrolled), the same figures as the compile-only report, whose roofline is quoted.

Every mesh also compiles `all_gather` with a bf16 combine at microbatches 1 with `model.moe_chunks`
EP_CHUNKS: the gathered tokens go through the experts a chunk at a time, so its buffers fit a v5e
without splitting the step (and re-gathering the weights) per microbatch.

CPU part. One MoE layer (T 2048 tokens, D 256, F 512, 16 experts, top-4, float32), forward and backward
(value and gradient of sum(y·probe) with respect to x and both expert weights; top-k routing of fixed
router logits inside the function), jitted for 8 host CPU devices on a mesh data 1 × fsdp 2 × expert 4,
for each dispatch (gspmd; all_to_all and all_gather with fp32 and bf16 payloads), against the one-device
layer (`moe.dropless_moe`, what `moe_layer` runs without a mesh) measured in the same run. Two warm-ups,
then `--repeats` rounds over every function in turn; the median wall time, its ratio to the one-device
layer, and the error of the output (max |y − y₁| / max |y₁|) and of the gradients (‖g − g₁‖ / ‖g₁‖)
against it. One JSON line per variant. Eight devices sharing the host's cores measure the overhead of
the dispatch, not a speed-up.

Targets: the variant with the least traffic cuts the per-step collective bytes by ≥ 2× against GSPMD at
the same microbatches (`target_met` in the summary line, which also gives the cut against GSPMD at its own
microbatches 1); on CPU, every variant's output within 1e-5 (fp32 payload) / 1e-2 (bf16) of the
one-device layer.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
)

import argparse
import json
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from upcycler.errors import UpcyclerError
from upcycler.train.aot import collectives
from upcycler.train.aot.compile import compile_only, target
from upcycler.train.config import ModelConfig, load_config
from upcycler.train.loop import sharding
from upcycler.train.model import expert_parallel, moe

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "bench/configs/moe-13b-a2b-v5e-256.yaml"
EP_DISPATCHES = ("all_to_all", "all_gather")
EP_MICROBATCHES = 4  # every EP variant fits a v5e at 4 (at 1 their dropless buffers do not)
EP_CHUNKS = 4  # all_gather at microbatches 1 fits with its gathered tokens in 4 chunks (model.moe_chunks)
TRAFFIC_CUT_TARGET = 2.0
MOE_MARKER = "shard_map"  # op names of everything traced inside `sharding.per_device`, i.e. the MoE layer

CPU_SHAPE = {"tokens": 2048, "d_model": 256, "width": 512, "experts": 16, "top_k": 4}
CPU_MESH = {"data": 1, "fsdp": 2, "expert": 4}
CPU_VARIANTS = {  # name: (dispatch, comm dtype)
    "gspmd": ("gspmd", "fp32"),
    "all_to_all/fp32": ("all_to_all", "fp32"),
    "all_to_all/bf16": ("all_to_all", "bf16"),
    "all_gather/fp32": ("all_gather", "fp32"),
    "all_gather/bf16": ("all_gather", "bf16"),
}
CPU_ERROR_TARGET = {"fp32": 1e-5, "bf16": 1e-2}
WARMUPS = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("compile", "cpu"), help="run one part only")
    parser.add_argument("--topology", default="v5e-256", help="TPU slice to compile for (v5p-256: ragged)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of the CPU part (median)")
    parser.add_argument("--full", action="store_true",
                        help="mesh.expert 8 and 16, comm dtypes fp32/bf16/fp8, EP at microbatches 1, "
                             "grad_comm_dtype bf16 for the best variant")
    parser.add_argument("--microbatches", type=int, default=EP_MICROBATCHES,
                        help="data.microbatches of the expert-parallel compiles and of the second gspmd baseline")
    parser.add_argument("--expert", type=int, action="append",
                        help="mesh.expert sizes to compile (default 8; with --full 8 and 16)")
    return parser.parse_args()


# ------------------------------------------------------------------------------------------ compile part


@contextmanager
def captured_hlo() -> Iterator[list[str]]:
    """The optimised HLO texts `compile_only` hands to `collectives.collective_traffic` meanwhile."""
    texts: list[str] = []
    original = collectives.collective_traffic

    def capture(text: str) -> collectives.CollectiveTraffic:
        texts.append(text)
        return original(text)

    collectives.collective_traffic = capture
    try:
        yield texts
    finally:
        collectives.collective_traffic = original


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")


def traffic_once(hlo: str) -> dict:
    """Collective traffic per device per step from `hlo` (`collectives.collective_traffic`), by kind and by
    source (see the module docstring), and whether the exchanges are ragged all-to-alls."""
    parsed = collectives.collective_traffic(hlo)
    op_names: dict[str, str] = {}
    ragged = False
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        name, rest = m.groups()
        source = re.search(r'op_name="([^"]*)"', rest)
        op_names[name] = source.group(1) if source else ""
        ragged = ragged or " ragged-all-to-all(" in rest
    kinds = {kind: k.traffic_bytes for kind, k in parsed.kinds.items()}
    sources = {"moe_layer": 0.0, "rest": 0.0, "unnamed": 0.0}
    for op in parsed.ops:
        name = op_names.get(op.name, "")
        sources["moe_layer" if MOE_MARKER in name else "rest" if name else "unnamed"] += op.traffic_bytes * op.executions
    return {"kinds": kinds, "total": parsed.traffic_bytes, "sources": sources, "ragged": ragged,
            "unknown_loops": list(parsed.unknown_loops)}


def compile_runs(expert: int, full: bool, microbatches: int) -> list[tuple[str, dict[str, str]]]:
    """(label, overrides) of the compiles for one `mesh.expert` size, the gspmd baselines first."""
    mb = {"data.microbatches": str(microbatches)}
    runs = [("gspmd/mb1", {"model.moe_dispatch": "gspmd", "data.microbatches": "1"})]
    if microbatches != 1:
        runs.append((f"gspmd/mb{microbatches}", {"model.moe_dispatch": "gspmd", **mb}))
    for dispatch in EP_DISPATCHES:
        for comm in ("fp32", "bf16", "fp8") if full else ("bf16",):
            runs.append((f"{dispatch}/{comm}/mb{microbatches}",
                         {"model.moe_dispatch": dispatch, "model.comm_dtype": comm, **mb}))
    runs.append((f"all_gather/bf16/mb1/chunks{EP_CHUNKS}", {"model.moe_dispatch": "all_gather",
                 "model.comm_dtype": "bf16", "data.microbatches": "1", "model.moe_chunks": str(EP_CHUNKS)}))
    for dispatch in EP_DISPATCHES:
        if full and microbatches != 1:
            runs.append((f"{dispatch}/bf16/mb1",
                         {"model.moe_dispatch": dispatch, "model.comm_dtype": "bf16", "data.microbatches": "1"}))
    return [(label, {"mesh.expert": str(expert), "mesh.fsdp": "-1", **o}) for label, o in runs]


def compile_one(label: str, overrides: dict[str, str], topology: str, chip) -> dict:
    """Compile the reference workload with `overrides` and measure it (see the module docstring)."""
    path = ROOT / CONFIG
    config = load_config(path, {"model.init": str(ROOT / load_config(path).model.init)},
                         [f"{k}={v}" for k, v in overrides.items()])
    line = {"bench": "expert_parallel", "part": "compile", "variant": label, "topology": topology,
            "mesh": {"expert": int(overrides["mesh.expert"])}, "dispatch": config.model.moe_dispatch,
            "comm_dtype": config.model.comm_dtype, "grad_comm_dtype": config.model.grad_comm_dtype,
            "microbatches": config.data.microbatches}
    started = time.perf_counter()
    with captured_hlo() as texts:
        try:
            report = compile_only(config, topology=topology)
        except UpcyclerError as err:  # a refusal other than running out of memory
            return {**line, "fits": False, "failure": str(err),
                    "compile_seconds": round(time.perf_counter() - started, 1)}
    m = report.memory
    line.update(mesh=report.mesh, fits=report.fits, failure=report.failure, hbm_bytes=report.budget,
                peak_bytes=m.peak, memory_bytes={"params": m.params, "optimizer": m.optimizer,
                                                 "gradients": m.gradients, "batch": m.batch,
                                                 "working": m.working})
    if texts:
        t = traffic_once(texts[0])
        line.update(traffic_bytes=t["kinds"], traffic_total=t["total"], traffic_by_source=t["sources"])
        if t["unknown_loops"]:
            line["unknown_loops"] = t["unknown_loops"]
        if config.model.moe_dispatch == "all_to_all":
            line["all_to_all_transport"] = "ragged" if t["ragged"] else "padded"
    if report.roofline:
        line["roofline"] = {k: v for k, v in report.roofline.items() if k != "chip"}
        line["mfu_bound"] = report.roofline["mfu"]
    line["compile_seconds"] = round(report.compile_seconds, 1)
    return line


def with_ratios(line: dict, lines: dict[str, dict]) -> dict:
    """`line` with its traffic over gspmd's at the same microbatches and at microbatches 1 (from `lines`)."""
    for key, base in (("traffic_vs_gspmd", f"gspmd/mb{line['microbatches']}"), ("traffic_vs_gspmd_mb1", "gspmd/mb1")):
        base_total = lines.get(base, {}).get("traffic_total")
        if "traffic_total" in line and base_total:
            line[key] = round(line["traffic_total"] / base_total, 4)
    return line


def best_variant(lines: dict[str, dict]) -> str | None:
    """The expert-parallel line that fits with the least traffic."""
    fitting = [(line["traffic_total"], label) for label, line in lines.items()
               if not label.startswith("gspmd") and line.get("fits") and "traffic_total" in line]
    return min(fitting)[1] if fitting else None


def compile_mesh(topology: str, chip, expert: int, full: bool, microbatches: int) -> dict:
    """Print the lines of one `mesh.expert` size; return its summary."""
    lines: dict[str, dict] = {}
    runs = compile_runs(expert, full, microbatches)
    for label, overrides in runs:
        lines[label] = with_ratios(compile_one(label, overrides, topology, chip), lines)
        print(json.dumps(lines[label]), flush=True)
    best = best_variant(lines)
    if full and best is not None:
        label = f"{best}/grad_bf16"
        overrides = {**dict(runs)[best], "model.grad_comm_dtype": "bf16"}
        lines[label] = with_ratios(compile_one(label, overrides, topology, chip), lines)
        print(json.dumps(lines[label]), flush=True)
        best = best_variant(lines)
    base = lines.get(f"gspmd/mb{microbatches}", {}).get("traffic_total")
    base1 = lines.get("gspmd/mb1", {}).get("traffic_total")
    total = lines[best]["traffic_total"] if best else None
    return {
        "best": best, "traffic_total": total, "gspmd_traffic_total": base, "gspmd_mb1_traffic_total": base1,
        "cut_vs_gspmd": round(base / total, 3) if best and base else None,
        "cut_vs_gspmd_mb1": round(base1 / total, 3) if best and base1 else None,
        "mfu_bound": lines[best].get("mfu_bound") if best else None,
        "gspmd_mfu_bound": {k: lines.get(k, {}).get("mfu_bound")
                            for k in ("gspmd/mb1", f"gspmd/mb{microbatches}")},
    }


def compile_part(topology: str, experts: list[int], full: bool, microbatches: int) -> None:
    chip = target(topology).chip
    summary = {str(expert): compile_mesh(topology, chip, expert, full, microbatches) for expert in experts}
    met = all(s["cut_vs_gspmd"] is not None and s["cut_vs_gspmd"] >= TRAFFIC_CUT_TARGET for s in summary.values())
    print(json.dumps({"bench": "expert_parallel", "part": "compile_summary", "topology": topology,
                      "by_expert_axis": summary, "target": f"traffic cut >= {TRAFFIC_CUT_TARGET}x vs gspmd",
                      "target_met": met}), flush=True)


# ---------------------------------------------------------------------------------------------- CPU part


def cpu_inputs(key: jax.Array) -> tuple[jax.Array, ...]:
    """x_TD, router logits_TE, w_gate_up_EDU, w_down_EDF, probe_TD with unit-variance activations."""
    T, D, F, E = (CPU_SHAPE[k] for k in ("tokens", "d_model", "width", "experts"))
    k = jax.random.split(key, 5)
    return (jax.random.normal(k[0], (T, D)), jax.random.normal(k[1], (T, E)),
            jax.random.normal(k[2], (E, D, 2 * F)) * D**-0.5, jax.random.normal(k[3], (E, D, F)) * F**-0.5,
            jax.random.normal(k[4], (T, D)))


def layer_and_grads(cfg: ModelConfig):
    """(y, grads wrt x, w_gate_up, w_down) of sum(y·probe), routing from the logits inside."""

    def loss(x, logits, w_gu, w_down, probe):
        routing = moe.route(logits, CPU_SHAPE["top_k"], "renormalized")
        y = expert_parallel.moe_layer(x, w_gu, w_down, routing, cfg, sharding.PLACEMENT)
        return jnp.sum(y.astype(jnp.float32) * probe), y

    grad = jax.value_and_grad(loss, argnums=(0, 2, 3), has_aux=True)

    def run(*args):
        (_, y), grads = grad(*args)
        return y, grads

    return run


def place(mesh, arrays):
    axes = (expert_parallel.TOKEN_AXES, expert_parallel.TOKEN_AXES, *expert_parallel.WEIGHT_AXES,
            expert_parallel.TOKEN_AXES)
    return [jax.device_put(a, NamedSharding(mesh, sharding.logical_to_spec(ax, a.shape, mesh)))
            for a, ax in zip(arrays, axes, strict=True)]


def max_relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def norm_relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cpu_part(repeats: int) -> None:
    devices = jax.devices("cpu")
    needed = int(np.prod(list(CPU_MESH.values())))
    if len(devices) < needed:
        raise SystemExit(f"the CPU part needs {needed} host devices, JAX sees {len(devices)}")
    inputs = cpu_inputs(jax.random.key(0))
    one = [jax.device_put(a, devices[0]) for a in inputs]
    calls = {"one_device": (jax.jit(layer_and_grads(ModelConfig())).lower(*one).compile(), one)}
    mesh = sharding.make_mesh(**CPU_MESH, devices=devices[:needed])
    for name, (dispatch, comm) in CPU_VARIANTS.items():
        with jax.set_mesh(mesh):
            placed = place(mesh, inputs)
            fn = jax.jit(layer_and_grads(ModelConfig(moe_dispatch=dispatch, comm_dtype=comm)))
            calls[name] = (fn.lower(*placed).compile(), placed)

    outputs = {name: jax.block_until_ready(fn(*args)) for name, (fn, args) in calls.items()}
    for _ in range(WARMUPS - 1):
        for fn, args in calls.values():
            jax.block_until_ready(fn(*args))
    wall: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            started = time.perf_counter()
            jax.block_until_ready(fn(*args))
            wall[name].append(time.perf_counter() - started)
    seconds = {name: statistics.median(times) for name, times in wall.items()}

    ref_y, ref_grads = outputs["one_device"]
    for name, (dispatch, comm) in CPU_VARIANTS.items():
        y, grads = outputs[name]
        error = max_relative(y, ref_y)
        print(json.dumps({
            "bench": "expert_parallel", "part": "cpu", "variant": name, "dispatch": dispatch, "comm_dtype": comm,
            "mesh": CPU_MESH, "shape": CPU_SHAPE, "dtype": "float32", "repeats": repeats,
            "seconds": round(seconds[name], 4), "one_device_seconds": round(seconds["one_device"], 4),
            "ratio_to_one_device": round(seconds[name] / seconds["one_device"], 3),
            "max_rel_error_y": error,
            "rel_error_grads": {g: norm_relative(a, b) for g, a, b in
                                zip(("x", "w_gate_up", "w_down"), grads, ref_grads, strict=True)},
            "error_target": CPU_ERROR_TARGET[comm], "target_met": error <= CPU_ERROR_TARGET[comm],
        }), flush=True)


def main() -> None:
    args = parse_args()
    if args.only in (None, "cpu"):
        cpu_part(args.repeats)
    if args.only in (None, "compile"):
        experts = args.expert or ([8, 16] if args.full else [8])
        compile_part(args.topology, experts, args.full, args.microbatches)


if __name__ == "__main__":
    main()
