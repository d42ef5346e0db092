"""Benchmark checkpoint surgery on synthetic checkpoints with real tensor shapes (bf16 safetensors).

    python bench/surgery.py [--scale 1.0] [--workdir DIR] [--only depth|moe|sources] [--repeats 3]
                            [--before PYTHON]

(a) depth 32 → 48 (SOLAR) at Llama-3-8B shapes; (b) dense-to-moe 8 experts top-2 and 64 experts top-8
G=8 (the same 13.6 GB of output; memory must not grow with the expert count) at Llama-3.2-1B shapes;
then (`--only moe-8b` alone) the same at Llama-3-8B shapes, 8 experts top-2 if the disk holds 94 GB of
output, else 8 experts top-4 G=4 (27 GB); these are function-preserving,
so each also runs with `--no-verify` in the same rounds and `check_overhead` is the median extra time of
the function check every such write runs before its rename. `--scale s` shrinks the
widths and the vocabulary by `s` for a quick run (layer counts stay). Each surgery runs in a fresh
subprocess that reports its own peak RSS (VmHWM). Two baselines copy the output's number of bytes in the
same rounds: `ratio` is to a copy with the job's I/O shape (`os.sendfile` of the source files, cyclically,
each copy fsynced) and `ratio_cp` to `cp -r` of the source directory (repeated and scaled to the bytes,
fsynced); the source is read once before each, so all start from the same page cache. Rounds are
interleaved (job, copy, cp), `--repeats` of them (default 3), and medians are reported, one JSON line per
benchmark with each round's seconds. `--before PYTHON` runs each job under another interpreter too (an
older upcycler) in the same rounds: `before_ratio`, `before_ratio_cp`, `speedup`. The synthetic files are deleted at the end, also on failure.

(c) `--only sources`: Branch-Train-MiX, dense-to-moe 8 experts top-2 from 4 dense models of Llama-3.2-1B
shapes (`--experts-from s0=… s3=…`, 2 experts each; BASE is s0, so attention, norms and embeddings are s0's),
each source written with its own seed (same architecture, different bytes). Not function-preserving, so there
is no check to time. Same rounds as above: the job, then copies of its
output bytes (cycling over the sources' files, and `cp -r` of BASE). Then the same job once with 2 sources (4 experts each) and
once with 8 (1 each) for `rss_by_sources`: peak RSS should not grow with the number of sources.
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

from common import write_synthetic

from upcycler.spec import ModelSpec


def llama_spec(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
               tied: bool, scale: float) -> ModelSpec:
    """A Llama-family spec with widths and vocabulary shrunk by `scale` (head_dim and layers kept)."""
    h = max(1, round(heads * scale))
    kv = max(1, round(kv_heads * scale))
    h -= h % kv
    return ModelSpec(family="llama", vocab_size=max(1024, round(vocab * scale)), hidden_size=h * head_dim,
                     num_layers=layers, num_heads=h, num_kv_heads=kv, head_dim=head_dim,
                     intermediate_size=64 * max(1, round(intermediate * scale / 64)), rope_theta=500000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=8192, tie_embeddings=tied)


def run_child(args: list[str], python: str = sys.executable) -> dict:
    """Run `upcycle ARGS` in a fresh `python` process that reports its wall time and peak RSS."""
    # VmHWM is this process's own peak RSS (ru_maxrss can carry the parent's peak across fork + exec)
    code = ("import json, sys, time\n"
            "from upcycler.cli import main\n"
            "t = time.perf_counter()\n"
            "main(sys.argv[1:], standalone_mode=False)\n"
            "seconds = time.perf_counter() - t\n"
            "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
            "print(json.dumps({'seconds': seconds, 'peak_rss': int(hwm.split()[1]) * 1024}))\n")
    # -P: `python`'s own upcycler, never one in the working directory (a checkout of another version)
    proc = subprocess.run([python, "-P", "-c", code, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"upcycle {' '.join(args)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def copy_seconds(sources: list[Path], nbytes: int, workdir: Path) -> float:
    """Seconds to copy `nbytes` from `sources` (cyclically) to new files with fsync, deleting each copy."""
    done, start = 0, time.perf_counter()
    k = 0
    while done < nbytes:
        src = sources[k % len(sources)]
        count = min(src.stat().st_size, nbytes - done)
        dst = workdir / f"copy-{k}"
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            sent = 0
            while sent < count:
                sent += os.sendfile(fout.fileno(), fin.fileno(), sent, count - sent)
            os.fsync(fout.fileno())
        dst.unlink()
        done += count
        k += 1
    return time.perf_counter() - start


def cp_seconds(source: Path, nbytes: int, workdir: Path) -> float:
    """Seconds `cp -r` takes for `nbytes`: the source directory copied (and fsynced) as many times as it takes
    to reach `nbytes`, the time scaled to exactly `nbytes` (the issue's first baseline)."""
    size = dir_bytes(source)
    copies = max(1, -(-nbytes // size))
    start = time.perf_counter()
    for k in range(copies):
        dst = workdir / f"cp-{k}"
        subprocess.run(["cp", "-r", str(source), str(dst)], check=True)
        for f in dst.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        shutil.rmtree(dst)
    return (time.perf_counter() - start) * nbytes / (copies * size)


def warm(files: list[Path]) -> None:
    """Read `files` once so the surgery and the copy both start from the same page-cache state."""
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def measure(name: str, source: Path, out: Path, args: list[str], repeats: int, extra: dict,
            checked: bool = False, files: list[Path] | None = None, before: str | None = None) -> dict:
    """Median wall time, peak RSS and ratio to two copies of the output's bytes, all in the same rounds:
    `copy` (same I/O shape: the job's own input files sendfile'd cyclically into new files, fsynced) and
    `cp` (`cp -r` of the source directory, scaled to the output's bytes). With `checked` (a
    function-preserving job), the job also runs with --no-verify, and the cost of its function check is
    reported as the extra time over that run. With `before` (another interpreter, whose upcycler is an
    older version), the same job runs under it too, so before and after share the rounds and baselines.
    `files` (default: `source`'s) are what the job reads: warmed before each run and copied by `copy`."""
    runs = []
    files = sorted(source.glob("*.safetensors")) if files is None else files
    job = [*args[:1], str(source), str(out), *args[1:]]
    for _ in range(repeats):
        row = {}
        if checked:
            warm(files)
            unchecked = run_child([*job, "--no-verify"])
            shutil.rmtree(out)
            row = {"unchecked_seconds": unchecked["seconds"], "unchecked_peak_rss": unchecked["peak_rss"]}
        if before:
            warm(files)
            old = run_child([*job, *(["--no-verify"] if checked else [])], python=before)
            shutil.rmtree(out)
            row.update(before_seconds=old["seconds"], before_peak_rss=old["peak_rss"])
        warm(files)
        child = run_child(job)
        nbytes = dir_bytes(out)
        shutil.rmtree(out)
        warm(files)
        copy = copy_seconds(files, nbytes, out.parent)
        warm(files)
        cp = cp_seconds(source, nbytes, out.parent)
        runs.append({**child, **row, "bytes": nbytes, "copy_seconds": copy, "cp_seconds": cp})
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = {"bench": name, **extra, "seconds": round(med["seconds"], 2), "output_bytes": int(med["bytes"]),
              "copy_seconds": round(med["copy_seconds"], 2), "cp_seconds": round(med["cp_seconds"], 2),
              "ratio": round(med["seconds"] / med["copy_seconds"], 3),
              "ratio_cp": round(med["seconds"] / med["cp_seconds"], 3),
              "peak_rss_mb": round(med["peak_rss"] / 2**20), "repeats": repeats,
              "runs_s": [[round(r[k], 1) for k in ("seconds", "copy_seconds", "cp_seconds")] for r in runs]}
    if extra.get("sources"):  # the multi-source case also shows each round's peak (a shared, noisy machine)
        result["runs_peak_rss_mb"] = [round(r["peak_rss"] / 2**20) for r in runs]
    key = "unchecked_seconds" if checked else "seconds"
    if checked:
        overheads = [r["seconds"] / r["unchecked_seconds"] - 1 for r in runs]
        result.update(unchecked_seconds=round(med["unchecked_seconds"], 2),
                      unchecked_ratio=round(med["unchecked_seconds"] / med["copy_seconds"], 3),
                      unchecked_ratio_cp=round(med["unchecked_seconds"] / med["cp_seconds"], 3),
                      unchecked_peak_rss_mb=round(med["unchecked_peak_rss"] / 2**20),
                      check_overhead=round(statistics.median(overheads), 3))
    if before:  # compared with the same kind of run: unchecked when the job is function-preserving
        result.update(before_seconds=round(med["before_seconds"], 2),
                      before_ratio=round(med["before_seconds"] / med["copy_seconds"], 3),
                      before_ratio_cp=round(med["before_seconds"] / med["cp_seconds"], 3),
                      before_peak_rss_mb=round(med["before_peak_rss"] / 2**20),
                      speedup=round(med["before_seconds"] / med[key], 3))
    return result


def moe_8b(spec: ModelSpec, work: Path, repeats: int, extra: dict, before: str | None) -> dict:
    """dense-to-moe at Llama-3-8B shapes with its default check: 8 experts top-2 (94 GB out) when the disk
    holds the source, the output and the copies' scratch; else 8 experts of a quarter width, top-4 (two
    copies of every FFN, 27 GB out), the largest such job that fits."""
    mlp = spec.num_layers * 3 * spec.hidden_size * spec.intermediate_size * 2
    source = spec.total_params() * 2
    free = shutil.disk_usage(work).free
    for experts, topk, granularity in ((8, 2, 1), (8, 4, 4)):
        out = source + mlp * (experts // granularity - 1)
        if source + out + 5e9 < free:
            break
    else:
        return {"bench": "dense-to-moe, Llama-3-8B shapes", "skipped": f"{free / 1e9:.0f} GB free is too little"}
    src = work / "llama-3-8b"
    write_synthetic(spec, src)
    try:
        args = ["dense-to-moe", "--experts", str(experts), "--topk", str(topk), "--granularity", str(granularity)]
        name = f"dense-to-moe {experts} experts top-{topk} G={granularity}, Llama-3-8B shapes"
        return measure(name, src, work / "out", args, repeats, {**extra, "experts": experts}, checked=True,
                       before=before)
    finally:
        shutil.rmtree(src)


def link_copy(src: Path, dst: Path) -> None:
    """`dst`, a new directory whose files are hard links to `src`'s (another model to the tool, same bytes)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            os.link(f, dst / f.name)


def multi_source(spec: ModelSpec, work: Path, repeats: int, extra: dict, before: str | None) -> dict:
    """dense-to-moe 8 experts top-2 from 4 sources (BASE = s0), timed against a copy; then peak RSS at 2 and 8."""
    dirs = [work / f"s{i}" for i in range(8)]
    for i in range(4):
        write_synthetic(spec, dirs[i], seed=i)
    # Sources 4..7 are hard links to the files of 0..3 in other directories (other models to the tool; it
    # checks no identity between sources). This does not change what is measured: each source is still read
    # tensor by tensor with its own preads, the same bytes as 8 distinct files, and peak RSS does not depend
    # on the values; only 10 GB of disk instead of 20 GB, and the page cache holds the same 4 × 2.5 GB.
    for i in range(4, 8):
        link_copy(dirs[i - 4], dirs[i])

    def job(n: int) -> list[str]:
        return ["dense-to-moe", "--experts", "8", "--topk", "2", "--experts-from",
                *(f"s{i}={dirs[i]}" for i in range(n))]

    files = [f for d in dirs[:4] for f in sorted(d.glob("*.safetensors"))]
    result = measure("dense-to-moe 8 experts top-2 from 4 sources (--experts-from), Llama-3.2-1B shapes", dirs[0],
                     work / "out", job(4), repeats, {**extra, "experts": 8, "sources": 4}, files=files,
                     before=before)
    rss = {"4": result["peak_rss_mb"]}
    seconds = {"4": result["seconds"]}
    for n in (2, 8):
        warm(files)
        child = run_child([job(n)[0], str(dirs[0]), str(work / "out"), *job(n)[1:]])
        shutil.rmtree(work / "out")
        rss[str(n)], seconds[str(n)] = round(child["peak_rss"] / 2**20), round(child["seconds"], 2)
    for d in dirs:
        shutil.rmtree(d)
    result["rss_by_sources"] = {k: rss[k] for k in ("2", "4", "8")}
    result["seconds_by_sources"] = {k: seconds[k] for k in ("2", "4", "8")}  # 2 and 8: one run each
    result["load_avg_1m"] = round(os.getloadavg()[0], 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="shrink widths and vocabulary (1.0 = real shapes)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the synthetic files go (default: a temp dir)")
    ap.add_argument("--only", choices=("depth", "moe", "moe-8b", "sources"), default=None)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per job; medians are reported")
    ap.add_argument("--before", default=None, metavar="PYTHON",
                    help="also run every job with this interpreter (one whose upcycler is an older version), "
                         "in the same rounds, for before/after figures")
    a = ap.parse_args()
    big = llama_spec(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                     tied=False, scale=a.scale)
    small = llama_spec(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256,
                       tied=True, scale=a.scale)
    if a.workdir is not None:
        a.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="surgery-bench-", dir=a.workdir))
    try:
        need = 0
        if a.only in (None, "depth"):
            need = max(need, big.total_params() * 2 * (1 + 1.5) + 5e9)
        if a.only in (None, "moe"):
            need = max(need, small.total_params() * 2 * (1 + 6) + 5e9)
        if a.only in (None, "sources"):  # 4 sources and one output of 8 full-width experts
            need = max(need, small.total_params() * 2 * (4 + 6) + 5e9)
        free = shutil.disk_usage(work).free
        if free < need:
            raise SystemExit(f"needs about {need / 1e9:.0f} GB free in {work}, has {free / 1e9:.0f} GB; "
                             "use --scale to shrink the shapes")
        scale = {"scale": a.scale}
        repeats, before = a.repeats, a.before
        if a.only in (None, "depth"):
            src = work / "llama-3-8b"
            write_synthetic(big, src)
            print(json.dumps(measure("depth 32->48 solar, Llama-3-8B shapes", src, work / "out",
                                     ["depth", "--layers", "48", "--method", "solar"], repeats, scale,
                                     before=before)), flush=True)
            shutil.rmtree(src)
        if a.only in (None, "moe"):
            src = work / "llama-3.2-1b"
            write_synthetic(small, src)
            for experts, topk, granularity in ((8, 2, 1), (64, 8, 8)):
                args = ["dense-to-moe", "--experts", str(experts), "--topk", str(topk),
                        "--granularity", str(granularity)]
                name = f"dense-to-moe {experts} experts top-{topk} G={granularity}, Llama-3.2-1B shapes"
                print(json.dumps(measure(name, src, work / "out", args, repeats, {**scale, "experts": experts},
                                         checked=True, before=before)), flush=True)
            shutil.rmtree(src)
        if a.only in (None, "moe", "moe-8b"):
            row = moe_8b(big, work, repeats, scale, before)
            print(json.dumps(row), flush=True)
        if a.only in (None, "sources"):
            print(json.dumps(multi_source(small, work, repeats, scale, before)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
