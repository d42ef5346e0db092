"""Benchmark `upcycle merge --method linear` over 4 synthetic bf16 checkpoints of Llama-3.2-1B shape.

    python bench/merge.py [--scale 1.0] [--inputs 4] [--repeat 3] [--workdir DIR] [--before PYTHON]

Writes `--inputs` random bf16 HF checkpoints (vocab 128256, hidden 2048, 16 layers, 32 heads, 8 KV
heads, intermediate 8192, tied embeddings: 1.24B parameters, 2.5 GB each; `--scale s` shrinks widths
and vocabulary by s), then times, each in a fresh process reading inputs evicted from the page cache
and counting until the output is on disk (fsync):

    copy     the baseline: read every input file, then write one output's worth (a copy of the
             first input) — the bytes a merge must move, as plain file copies
    merge    upcycle merge IN… OUT --method linear --weights (0.1, 0.2, 0.3, 0.4 for 4 inputs)

and the peak RSS of the merge at 2, `--inputs` and 2×`--inputs` inputs (the extra inputs are the same
directories again under new names; memory does not depend on the values) to show that it is flat.
Peak RSS is the child's own VmHWM; CPU seconds (all threads) are reported beside the wall times,
since on a shared machine the wall time of the CPU-heavier merge moves with the load. With `--repeat r`, r copy/merge pairs run in alternating order
and medians are reported (the machine's load drifts); `--before PYTHON` adds a third run per round, the
same merge under another interpreter (an older upcycler), for before/after figures. Prints one JSON line, with the 1-minute load
average at the end. The files are deleted at the end, also on failure.
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
import time
from pathlib import Path

import numpy as np
from common import evict, write_synthetic

from upcycler.layout import declare_params
from upcycler.spec import ModelSpec

TARGET_RATIO = 1.1
_CHILD = """
import json, sys, time
from upcycler.cli import main
start, cpu = time.perf_counter(), time.process_time()
main.main(sys.argv[1:], standalone_mode=False)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
                  "peak_rss_mb": hwm / 1024}))
"""


def llama_1b(scale: float) -> ModelSpec:
    """Llama-3.2-1B's shape, widths and vocabulary multiplied by `scale` (head_dim and layers kept)."""
    kv = max(1, round(8 * scale))
    heads = max(kv, round(32 * scale) // kv * kv)
    return ModelSpec(family="llama", vocab_size=max(1024, round(128256 * scale)), hidden_size=heads * 64,
                     num_layers=16, num_heads=heads, num_kv_heads=kv, head_dim=64,
                     intermediate_size=64 * max(1, round(8192 * scale / 64)), rope_theta=500000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=8192, tie_embeddings=True)


def copy_baseline(inputs: list[Path], out: Path) -> dict[str, float]:
    """Seconds (and CPU seconds) to read every input file and write a copy of the first input's files,
    fsynced."""
    start, cpu = time.perf_counter(), time.process_time()
    buf = bytearray(16 * 2**20)
    for directory in inputs:
        for path in sorted(directory.glob("*.safetensors")):
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    out.mkdir()
    for path in sorted(inputs[0].iterdir()):
        with open(path, "rb") as fin, open(out / path.name, "wb") as fout:
            shutil.copyfileobj(fin, fout, 16 * 2**20)
            fout.flush()
            os.fsync(fout.fileno())
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}


def run_merge(inputs: list[Path], out: Path, python: str = sys.executable) -> dict[str, float]:
    """`upcycle merge` of `inputs` (linear, weights ∝ 1…n) in a fresh `python` process: seconds and peak RSS."""
    n = len(inputs)
    weights = ",".join(f"{(i + 1) / (n * (n + 1) / 2):.17g}" for i in range(n))
    args = ["merge", *map(str, inputs), str(out), "--method", "linear", "--weights", weights]
    # -P: `python`'s own upcycler, never one in the working directory (a checkout of another version)
    proc = subprocess.run([python, "-P", "-c", _CHILD, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"upcycle {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(scale: float, n: int, repeat: int, workdir: Path | None, before: str | None = None) -> dict:
    spec = llama_1b(scale)
    nbytes = spec.total_params() * 2
    work = Path(tempfile.mkdtemp(prefix="merge-bench-", dir=workdir))
    try:
        free = shutil.disk_usage(work).free
        if free < nbytes * (n + 2) + 2e9:
            raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, need {(nbytes * (n + 2) + 2e9) / 1e9:.1f} GB; "
                             "free space or lower --scale")
        start = time.perf_counter()
        inputs = [work / f"in{i}" for i in range(n)]
        for i, path in enumerate(inputs):
            write_synthetic(spec, path, seed=i)
        generate = time.perf_counter() - start
        for i in range(n, 2 * n):  # more inputs for the memory curve: the same files under other names
            (work / f"in{i}").symlink_to(inputs[i - n], target_is_directory=True)
        copies, merges, befores = [], [], []
        order = ["copy", "merge", *(["before"] if before else [])]
        for r in range(repeat):  # rotate which goes first, so drift in the machine's load hits all
            for which in order[r % len(order):] + order[:r % len(order)]:
                os.sync()  # the previous run's deletions reach the disk before the clock starts
                evict(work)
                if which == "copy":
                    copies.append(copy_baseline(inputs, work / "copy"))
                    shutil.rmtree(work / "copy")
                    continue
                runs = merges if which == "merge" else befores
                runs.append(run_merge(inputs, work / "out", sys.executable if which == "merge" else before))
                shutil.rmtree(work / "out")
        peaks = {n: max(m["peak_rss_mb"] for m in merges)}
        for k in (2, 2 * n):
            evict(work)
            peaks[k] = run_merge([work / f"in{i}" for i in range(k)], work / f"out{k}")["peak_rss_mb"]
            shutil.rmtree(work / f"out{k}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    copy_s, merge_s = (statistics.median(r["seconds"] for r in runs) for runs in (copies, merges))
    earlier = {}
    if befores:
        before_s = statistics.median(r["seconds"] for r in befores)
        earlier = {"before_s": round(before_s, 2), "before_ratio": round(before_s / copy_s, 3),
                   "before_runs_s": [round(b["seconds"], 1) for b in befores],
                   "before_peak_rss_mb": round(max(b["peak_rss_mb"] for b in befores)),
                   "before_cpu_s": round(statistics.median(b["cpu_s"] for b in befores), 1)}
    cpu = {name: round(statistics.median(r["cpu_s"] for r in runs), 1)
           for name, runs in (("copy", copies), ("merge", merges))}
    largest = max(int(np.prod(d.shape)) for d in declare_params(spec)) * 4
    return {
        "bench": "merge-linear", "shape": "llama-3.2-1b", "scale": scale, "params": spec.total_params(),
        "dtype": "bf16", "inputs": n, "input_bytes": nbytes, "generate_s": round(generate, 1), "repeat": repeat,
        "copy_s": round(copy_s, 2), "merge_s": round(merge_s, 2), "ratio": round(merge_s / copy_s, 3),
        "runs_s": [[round(c["seconds"], 1), round(m["seconds"], 1)] for c, m in zip(copies, merges)],
        "cpu_s": cpu,
        "peak_rss_mb": {str(k): round(v) for k, v in sorted(peaks.items())},
        "largest_tensor_fp32_mb": round(largest / 2**20), "target_ratio": TARGET_RATIO,
        "met": merge_s / copy_s <= TARGET_RATIO, **earlier, "load_avg_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="shrink widths and vocabulary (1.0 = real shapes)")
    ap.add_argument("--inputs", type=int, default=4, help="checkpoints averaged in the timed run")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (copy, merge); medians reported")
    ap.add_argument("--workdir", type=Path, default=None, help="where the synthetic files go (default: temp dir)")
    ap.add_argument("--before", default=None, metavar="PYTHON",
                    help="also merge with this interpreter (one whose upcycler is an older version) in the same rounds")
    a = ap.parse_args()
    print(json.dumps(run(a.scale, a.inputs, a.repeat, a.workdir, a.before)))


if __name__ == "__main__":
    main()
