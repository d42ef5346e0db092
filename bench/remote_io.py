"""Benchmark surgery with the model in a bucket (gs:// → gs://) against the same job on local disks.

    python bench/remote_io.py [--scale 0.5] [--repeats 3] [--workdir DIR]

A synthetic bf16 checkpoint at Llama-3.2-1B shapes (widths and vocabulary × `--scale`) is written locally
and uploaded once to a loopback Cloud Storage emulator (fake-gcs-server, started here and stopped at
the end: `tests/gcs_emulator.py`). Two jobs, `convert` and `dense-to-moe --experts 8 --topk 2`, each run
local → local and gs:// → gs:// in the same rounds, interleaved, `--repeats` rounds, every run in a fresh
process that reports its wall time and peak RSS (VmHWM). The remote run's time includes mirroring the
source (the first round fetches it; later rounds find the mirror current and only list the bucket; the
cache is emptied before every round so each one fetches) and publishing the output. One JSON line per
job: medians of `local_s`, `remote_s`, `ratio` (remote / local) and `rss_ratio` (remote peak / local
peak), and each round's figures. The emulator runs on the same cores, so `ratio` is an upper bound for
a real bucket's overhead on a fast network, not an estimate of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import write_synthetic
from surgery import llama_spec, run_child

from upcycler.io import object_store

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from gcs_emulator import start, stop

BUCKET = "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="upcycler-bench-remote-", dir=args.workdir))
    emulator, url = start(BUCKET)
    os.environ.update(STORAGE_EMULATOR_HOST=url, UPCYCLER_CACHE=str(work / "cache"))
    try:
        spec = llama_spec(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64,
                          vocab=128256, tied=True, scale=args.scale)
        source = work / "source"
        write_synthetic(spec, source)
        remote_source = f"gs://{BUCKET}/source"
        run_child(["convert", str(source), remote_source, "--no-verify"])  # upload once, untimed
        jobs = {"convert": ["convert", "{src}", "{out}"],
                "dense-to-moe": ["dense-to-moe", "{src}", "{out}", "--experts", "8", "--topk", "2"]}
        rounds: dict[str, list[dict]] = {name: [] for name in jobs}
        for k in range(args.repeats):
            for name, argv in jobs.items():
                figures = {}
                for where, src, out in (("local", str(source), str(work / f"out-{name}-{k}")),
                                        ("remote", remote_source, f"gs://{BUCKET}/out-{name}-{k}")):
                    shutil.rmtree(work / "cache", ignore_errors=True)
                    figures[where] = run_child([a.format(src=src, out=out) for a in argv])
                shutil.rmtree(work / f"out-{name}-{k}", ignore_errors=True)
                object_store.filesystem().rm(f"{BUCKET}/out-{name}-{k}", recursive=True)
                rounds[name].append({"local_s": figures["local"]["seconds"], "remote_s": figures["remote"]["seconds"],
                                     "local_rss": figures["local"]["peak_rss"],
                                     "remote_rss": figures["remote"]["peak_rss"]})
        source_bytes = sum(p.stat().st_size for p in source.iterdir())
        for name, runs in rounds.items():
            median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(json.dumps({"bench": f"remote_io/{name}", "source_bytes": source_bytes, "repeats": args.repeats,
                              **{k: round(v, 3) if k.endswith("_s") else v for k, v in median.items()},
                              "ratio": round(median["remote_s"] / median["local_s"], 3),
                              "rss_ratio": round(median["remote_rss"] / median["local_rss"], 3),
                              "rounds": runs}))
    finally:
        stop(emulator)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
