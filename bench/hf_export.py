"""Benchmark what `checkpoint.hf_every` costs the training steps: the same run with and without it.

    python bench/hf_export.py [--steps 120] [--every 10] [--repeat 3] [--workdir DIR]

The bundled demo model upcycled to an MoE (8 experts of the full width, top-2) trains
on the demo corpus (seq_len 128, batch 8) with an async checkpoint every `--every` steps, once with
`checkpoint.hf_every: --every` (a bf16 Hugging Face export of every saved step, written on the
background thread after the save commits) and once without: the baseline, measured in the same
invocation. Each run is a fresh process; with `--repeat r` the pairs alternate in order, since the
machine's load drifts. Step times come from the runs' own metrics.jsonl (step 0, the compile, left out).
Prints one JSON line: the median step time of each, their ratio, and the ratio of the steps right after
a save (where an export runs), with the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

SOURCES = ("code", "prose", "math")


def prepare(work: Path) -> tuple[Path, Path]:
    """Prepared demo data and the demo model as an MoE, built once."""
    from upcycler.cli.demo import demo_assets

    assets = demo_assets()
    tok = assets / "model" / "tokenizer.json"
    _upcycle("prepare-data", "--tokenizer", tok, "--out", work / "data",
             *[a for s in SOURCES for a in ("--source", f"{s}={assets / 'corpus' / f'{s}.train.jsonl'}")])
    _upcycle("dense-to-moe", assets / "model", work / "moe", "--experts", "8", "--topk", "2", "--granularity", "1",
             "--seed", "0")
    return work / "data", work / "moe"


def run(work: Path, name: str, data: Path, model: Path, steps: int, every: int, hf: bool) -> list[dict]:
    """One training run in a fresh process; its metrics records."""
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    config = {
        "run_dir": str(run_dir), "steps": steps,
        "model": {"init": str(model)},
        "data": {"dir": str(data), "seq_len": 128, "global_batch_size": 8, "seed": 0,
                 "phases": [{"weights": {"code": 0.4, "prose": 0.3, "math": 0.3}}]},
        "optimizer": {"lr": 1e-3},
        "checkpoint": {"every": every, "keep": 2, "async": True, "hf_every": every if hf else 0},
        "metrics": {"progress": False},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    _upcycle("continued-pretrain", "--config", path)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if hf:
        exports = sorted(p.parent.name for p in run_dir.glob("*/hf/config.json"))
        assert exports, "no Hugging Face export was written"
    return records


def _upcycle(*args) -> None:
    subprocess.run([sys.executable, "-m", "upcycler", *map(str, args)], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hf-export-", dir=args.workdir))
    try:
        data, model = prepare(work)
        times: dict[str, list[float]] = {"plain": [], "hf_every": []}
        after_save: dict[str, list[float]] = {"plain": [], "hf_every": []}
        for r in range(args.repeat):
            order = ("plain", "hf_every") if r % 2 == 0 else ("hf_every", "plain")
            for name in order:
                records = run(work, name, data, model, args.steps, args.every, hf=name == "hf_every")
                times[name] += [rec["step_time"] for rec in records[1:]]
                after_save[name] += [rec["step_time"] for rec in records[1:] if rec["step"] % args.every in (0, 1)]
        med = {k: statistics.median(v) for k, v in times.items()}
        after = {k: statistics.median(v) for k, v in after_save.items()}
        print(json.dumps({
            "bench": "hf_export", "steps": args.steps, "every": args.every, "repeat": args.repeat,
            "median_step_s": {k: round(v, 5) for k, v in med.items()},
            "ratio": round(med["hf_every"] / med["plain"], 4),
            "after_save_median_s": {k: round(v, 5) for k, v in after.items()},
            "after_save_ratio": round(after["hf_every"] / after["plain"], 4),
            "load_1min": os.getloadavg()[0],
        }))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
