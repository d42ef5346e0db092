"""Benchmark what a resume spends on the metrics log: cut it after the checkpoint's step, take the clock.

    python bench/resume_log.py [--steps 24000] [--every 100] [--layers 32] [--experts 64] [--sources 3]
                               [--repeat 5]

Writes the metrics log of the reference workload's run after `--steps` steps: one record a step with the
fields the trainer writes (losses per source, clock, goodput), and every `--every` steps the window's
expert load, usage by source ([layers][sources][experts]) and health. Then times, on copies of it, opening
the log as a resumed run does (`MetricsLog(start_step=steps - every // 2)`: the tail is read backwards and
cut in place) against the baseline: reading every record with `read_metrics`, what a resume did before.
Prints one JSON line with the medians of `--repeat` runs, their ratio and the log's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from upcycler.train.reporting.goodput import CATEGORIES
from upcycler.train.reporting.metrics import METRICS_FILE, read_metrics
from upcycler.train.reporting.metrics_log import MetricsLog


def write_log(path: Path, steps: int, every: int, layers: int, experts: int, sources: int) -> None:
    rng = np.random.default_rng(0)
    names = [f"source{s}" for s in range(sources)]
    with open(path, "w", encoding="utf-8") as f:
        for step in range(steps):
            clock = {c: float(step) for c in CATEGORIES} | {"total": float(step * len(CATEGORIES)),
                                                            "wall": 1.8e9 + step}
            record = {"step": step, "loss": 2.0, **{f"loss/{n}": 2.0 for n in names}, "lb_loss": 1.0,
                      "z_loss": 0.1, "total_loss": 2.01, "grad_norm": 0.5, "lr": 3e-4, "tokens": 2_000_000,
                      "step_time": 1.8, "tokens_per_s": 1.1e6, "mfu": 0.4, "data_wait": 0.001, "clock": clock,
                      "goodput": 0.9}
            if (step + 1) % every == 0:
                load = rng.dirichlet(np.ones(experts), size=layers)
                record["expert_load"] = np.round(load, 6).tolist()
                record["expert_load_by_source"] = np.round(
                    rng.dirichlet(np.ones(experts), size=(layers, sources)), 6).tolist()
                record["sources"] = names
                record["expert_health"] = {k: [0.5] * layers for k in ("load_min", "load_max", "load_cv",
                                                                        "dead", "overload", "entropy")}
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24_000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--sources", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        master = Path(tmp) / "master.jsonl"
        write_log(master, args.steps, args.every, args.layers, args.experts, args.sources)
        resume_at = args.steps - args.every // 2
        resumed, baseline = [], []
        for _ in range(args.repeat):
            run = Path(tmp) / "run"
            shutil.rmtree(run, ignore_errors=True)
            run.mkdir()
            shutil.copyfile(master, run / METRICS_FILE)
            t0 = time.perf_counter()
            read_metrics(run)
            baseline.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            log = MetricsLog(run, enabled=True, start_step=resume_at)
            resumed.append(time.perf_counter() - t0)
            log.close()
            assert log.kept["step"] == resume_at - 1 and log.last["step"] == args.steps - 1
        result = {
            "bench": "resume_log", "steps": args.steps, "log_bytes": os.path.getsize(master),
            "resume_s": statistics.median(resumed), "read_all_s": statistics.median(baseline),
            "speedup": statistics.median(baseline) / statistics.median(resumed), "repeat": args.repeat,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
