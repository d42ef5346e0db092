"""Compile the reference training workloads for the TPU pods they run on, on this host (needs `[tpu]`).

    python bench/aot.py                      # the workloads of bench/configs/ (4k, and 32k / 128k split over chips)
    python bench/aot.py --only moe-13b-a2b   # one of them
    python bench/aot.py --no-baseline        # skip the plain-step compile (half the time)
    python bench/aot.py --only moe-13b-a2b --set model.remat=attention   # a config option changed
    python bench/aot.py --plan --only moe-13b-a2b   # the planner: the best configuration that fits
    python bench/aot.py --only moe-13b-a2b --breakdown   # where the HBM traffic goes, per layer
    python bench/aot.py --only moe-13b-a2b-128k --exchanges   # a split sequence's keys and values: ring vs gather

For each workload (a config in `bench/configs/`, its model a config-only directory), the train step is
compiled with the config's memory options through `upcycler.train.aot.compile.compile_only`, the same path
as `upcycle continued-pretrain --compile-only --topology …`. The baseline, compiled in the same run, is
the plain step (remat none, fp32 weights, einsum attention, whole-vocabulary cross-entropy, one
microbatch) on the same slice: the line gives both peaks and their ratio, or says the plain step does
not fit (the compiler ran out of memory). One JSON line per workload: per-chip memory by category against
the chip's usable HBM, whether it fits and by how much, analytic FLOPs per step, collective traffic per
chip by kind, the roofline step time and MFU bound (HBM traffic with each Pallas kernel charged its own
cost estimate), the HBM traffic of one MoE layer, and the compile time. Targets: every workload fits; MFU
bound ≥ 0.7 for the reference MoE and ≥ 0.5 for the grown Llama on v5e; at 32k ≥ 0.6 and at 128k ≥ 0.5
for both, with 1 GiB to spare. The grouped-matmul kernels' tiles
follow the scoped VMEM libtpu gives a kernel, 64 MiB as upcycler starts it (`topology.libtpu_defaults`);
`LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=16384` compiles with libtpu's own default on v5e.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from upcycler.train.aot.compile import compile_only
from upcycler.train.config import load_config

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {  # name: (config, topology, MFU-bound target or None)
    "moe-13b-a2b": ("bench/configs/moe-13b-a2b-v5e-256.yaml", "v5e-256", 0.7),
    "llama3-8b-40-layers": ("bench/configs/llama3-8b-40-layers-v5e-256.yaml", "v5e-256", 0.5),
    "llama3-8b-8x-top2": ("bench/configs/llama3-8b-8x-top2-v5p-128.yaml", "v5p-128", None),
    # long context: each sequence split over mesh.context chips (targets from the long-context round)
    "moe-13b-a2b-32k": ("bench/configs/moe-13b-a2b-32k-v5e-256.yaml", "v5e-256", 0.6),
    "moe-13b-a2b-128k": ("bench/configs/moe-13b-a2b-128k-v5e-256.yaml", "v5e-256", 0.5),
    "llama3-8b-40-layers-32k": ("bench/configs/llama3-8b-40-layers-32k-v5e-256.yaml", "v5e-256", 0.6),
    "llama3-8b-40-layers-128k": ("bench/configs/llama3-8b-40-layers-128k-v5e-256.yaml", "v5e-256", 0.5),
}
PLAIN = ("model.remat=none", "model.weights_dtype=float32", "model.attention=einsum", "loss.ce_chunk=0",
         "data.microbatches=1")


def measure(name: str, baseline: bool, changes: tuple[str, ...] = (), breakdown: bool = False) -> dict:
    path, topology, target = WORKLOADS[name]
    config = load_config(ROOT / path, {"model.init": str(ROOT / load_config(ROOT / path).model.init)}, changes)
    report = compile_only(config, topology=topology)
    m = report.memory
    line = {
        "workload": name, "topology": topology, "total_params": report.model["total_params"],
        "active_params": report.model["active_params"], "options": report.options, "mesh": report.mesh,
        "hbm_bytes": report.budget, "fits": report.fits, "margin_bytes": report.margin, "failure": report.failure,
        "memory_bytes": {"params": m.params, "optimizer": m.optimizer, "gradients": m.gradients, "batch": m.batch,
                         "working": m.working, "peak": m.peak},
        "flops_per_step": report.flops["per_step"], "flops_per_token": report.flops["per_token"],
        "collective_traffic_bytes": {k: v["traffic_bytes"] for k, v in report.collectives.items()},
        "roofline": report.roofline, "mfu_bound": report.roofline["mfu"] if report.roofline else None,
        "moe_layer_hbm_bytes": report.moe_layer_bytes,
        "mfu_target": target, "compile_seconds": round(report.compile_seconds, 1),
    }
    if breakdown:
        line["hbm_sources"] = report.traffic_sources
    if baseline:
        plain = compile_only(load_config(ROOT / path, {"model.init": config.model.init}, PLAIN), topology=topology)
        line["baseline_plain"] = {"fits": plain.fits, "peak": plain.memory.peak, "failure": plain.failure,
                                  "compile_seconds": round(plain.compile_seconds, 1)}
        line["peak_vs_plain"] = m.peak / plain.memory.peak if plain.memory.peak and m.peak else None
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--breakdown", action="store_true",
                        help="add the largest sources of HBM traffic (line of code or kernel), per layer")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change a config option of every workload (repeatable), as `--set` in the CLI")
    parser.add_argument("--plan", action="store_true",
                        help="search each workload's options for the best bound that fits with 1 GiB to spare "
                             "(`upcycle continued-pretrain --compile-only --plan`), against the config as written")
    parser.add_argument("--plan-cache", type=Path, help="with --plan: keep compiled figures here between runs")
    parser.add_argument("--exchanges", action="store_true",
                        help="compile each workload with its split sequence's keys and values gathered whole (the "
                             "baseline) and passed around a ring (model.context_exchange), one line with both")
    args = parser.parse_args()
    for name in args.only or WORKLOADS:
        if args.exchanges:
            line = exchanges(name, tuple(args.set))
        elif args.plan:
            line = planned(name, tuple(args.set), args.plan_cache)
        else:
            line = measure(name, baseline=not args.no_baseline, changes=tuple(args.set), breakdown=args.breakdown)
        print(json.dumps(line), flush=True)


def exchanges(name: str, changes: tuple[str, ...]) -> dict:
    """The workload compiled with each `model.context_exchange`, the gather the baseline: per chip peak,
    HBM traffic, collective traffic and MFU bound, and the ring's ratios to the gather's."""
    figures = {}
    for exchange in ("gather", "ring"):
        line = measure(name, baseline=False, changes=(*changes, f"model.context_exchange={exchange}"))
        roofline = line["roofline"] or {}
        figures[exchange] = {"fits": line["fits"], "peak": line["memory_bytes"]["peak"],
                             "hbm_seconds": roofline.get("memory_s"), "mfu_bound": line["mfu_bound"],
                             "bound": roofline.get("bound"), "collective_bytes": line["collective_traffic_bytes"],
                             "compile_seconds": line["compile_seconds"]}
    gather, ring = figures["gather"], figures["ring"]

    def ratio(a, b):
        return a / b if a and b else None

    return {"workload": name, "topology": WORKLOADS[name][1], "mesh": line["mesh"],
            "gather": gather, "ring": ring,
            "ring_vs_gather": {"peak": ratio(ring["peak"], gather["peak"]),
                               "hbm": ratio(ring["hbm_seconds"], gather["hbm_seconds"]),
                               "collectives": ratio(sum(ring["collective_bytes"].values()),
                                                    sum(gather["collective_bytes"].values())),
                               "mfu_bound": ratio(ring["mfu_bound"], gather["mfu_bound"])}}


def planned(name: str, changes: tuple[str, ...], cache: Path | None) -> dict:
    """The plan of a workload: its best configuration, the planning time and every candidate, with the
    config as written compiled in the same run as the baseline."""
    from upcycler.train.aot.plan import plan

    path, topology, _ = WORKLOADS[name]
    config = load_config(ROOT / path, {"model.init": str(ROOT / load_config(ROOT / path).model.init)}, changes)
    as_written = compile_only(config, topology=topology)
    found = plan(config, topology, cache=cache, log=lambda line: print(line, file=sys.stderr, flush=True))
    best = json.loads(found.to_json())
    written_mfu = as_written.roofline["mfu"] if as_written.roofline and as_written.fits else 0.0
    return {"workload": name, "topology": topology, "planning_seconds": best["seconds"],
            "compiles": best["compiles"], "best": best["best"],
            "as_written": {"fits": as_written.fits, "peak": as_written.memory.peak, "mfu_bound": written_mfu,
                           "options": as_written.options},
            "best_vs_as_written": best["best"]["mfu"] / written_mfu if best["best"] and written_mfu else None,
            "outcomes": best["outcomes"]}


if __name__ == "__main__":
    main()
