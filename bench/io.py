"""Checkpoint I/O benchmark at real shape: is surgery's I/O close to a file copy, in bounded memory?

Builds a synthetic bf16 Llama-3-8B-shaped checkpoint (vocab 128256, hidden 4096, 32 layers, 32 heads,
8 KV heads, intermediate 14336: 16 GB) as sharded HF safetensors with a config.json, then times, each in
its own process and each reading a source evicted from the page cache:

    copy          the source shards copied with shutil.copyfile (the baseline, same disk, same run)
    hf_to_hf      upcycle convert SRC OUT --to hf --shard-size 2GB
    hf_to_orbax   upcycle convert SRC OUT --to orbax
    orbax_to_hf   upcycle convert ORBAX OUT --to hf --shard-size 2GB
    hf_checked    upcycle convert HF OUT, where HF is hf_to_hf's output: every byte read is checked against
                  the sha256 in its upcycler.json; `digest_cost_hf` = hf_checked / hf_to_hf
    orbax_unchecked  orbax_to_hf with the tensor digests removed from the manifest (nothing to check);
                  `digest_cost_orbax` = orbax_to_hf / orbax_unchecked

Every timing includes an fsync of every output file, so all runs pay for reaching the disk. Peak RSS is
the child's VmHWM, polled every 50 ms. Prints one JSON line: bytes, and per run the seconds, ratio to the
copy, CPU seconds and peak RSS (medians over `--repeat`); whether the targets (ratio <= 1.1, <= 1.2 for
Orbax, peak RSS < 1 GB) hold; with `--before PYTHON`, the three conversions also run under another
interpreter (an older upcycler) in the same rounds, as `before_*`; and the load average before and after, since a shared machine skews every ratio.

    python bench/io.py                      # the full 16 GB shape; needs about 2x16 GB free
    python bench/io.py --scale 0.25         # layers and widths x0.25 (~0.4 GB) for a quick run

The weights are random bits (a random 64 MiB block XORed with a fresh random word per 64 MiB), which is
as incompressible as real weights at generation speed. Everything is written under a temporary directory
in `--workdir` and removed at the end, also on failure.
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
from typing import Any

import numpy as np
from common import evict

from upcycler.families import family_for_config
from upcycler.io.safetensors_file import encode_header
from upcycler.layout import declare_params
from upcycler.tensors import BF16

BLOCK = 64 * 1024**2
TARGET_RATIO = 1.1
TARGET_RATIO_ORBAX = 1.2
TARGET_RSS_MB = 1000


def llama3_8b_config(scale: float) -> dict[str, Any]:
    """A Llama-3-8B config.json, layers and widths multiplied by `scale` (widths stay multiples of 128)."""

    def width(n: int) -> int:
        return max(128, round(n * scale / 128) * 128)

    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": width(128256),
        "hidden_size": width(4096), "intermediate_size": width(14336),
        "num_hidden_layers": max(1, round(32 * scale)), "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001,
    }


def write_synthetic(src: Path, config: dict[str, Any], shard_size: int, seed: int = 0) -> int:
    """Write random bf16 weights for `config` as sharded safetensors, index and config.json; their bytes."""
    family = family_for_config(config, "config.json")
    spec = family.read_config(config)
    items = [(name, decl.shape[1:] if decl.expert_stacked else decl.shape, BF16)
             for decl in declare_params(spec) for name in family.hf_names(decl)]
    shards: list[list[tuple]] = [[]]
    size = 0
    for item in items:
        nbytes = int(np.prod(item[1])) * 2
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 2**63, size=BLOCK // 8, dtype=np.uint64)
    scratch = np.empty_like(block)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    src.mkdir(parents=True)
    total = 0
    for name, shard in zip(names, shards):
        with open(src / name, "wb") as f:
            f.write(encode_header(shard, {"format": "pt"}))
            left = sum(int(np.prod(shape)) * 2 for _, shape, _ in shard)
            while left:
                np.bitwise_xor(block, rng.integers(0, 2**63, dtype=np.uint64), out=scratch)
                n = min(left, BLOCK)
                f.write(memoryview(scratch.view(np.uint8))[:n])
                left -= n
                total += n
            os.fsync(f.fileno())
    weight_map = {item[0]: name for name, shard in zip(names, shards) for item in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text(json.dumps(config, indent=2))
    return total


def fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def measure(cmd: list[str], src: Path, out: Path, log: Path) -> dict[str, float]:
    """Run `cmd` as a child reading a cold `src`: seconds until `out` is on disk, CPU seconds, peak RSS."""
    evict(src)
    start = time.perf_counter()
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        peak_kb = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak_kb = max(peak_kb, high_water_rss_kb(proc.pid))
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise SystemExit(f"{' '.join(cmd)} failed with status {proc.returncode}:\n{tail}")
    fsync_tree(out)
    seconds = time.perf_counter() - start
    evict(out)
    return {"seconds": round(seconds, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mb": round(peak_kb / 1024)}


def high_water_rss_kb(pid: int) -> int:
    """The process's peak resident set (VmHWM) so far, 0 once it is gone.

    Read from /proc rather than `wait4`'s ru_maxrss, which also counts the parent's memory inherited
    before exec and would floor every child at this benchmark's own size.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def copy_tree(src: Path, dst: Path) -> None:
    """The baseline: every file of `src` copied to `dst` with shutil.copyfile."""
    dst.mkdir()
    for path in sorted(src.iterdir()):
        shutil.copyfile(path, dst / path.name)


def convert(src: Path, out: Path, to: str, python: str | None = None) -> list[str]:
    """The `upcycle convert` command line (through the installed script when there is one; through
    `python`'s upcycler when given)."""
    exe = None if python else shutil.which("upcycle")
    cli = [exe] if exe else [python or sys.executable, "-P", "-c", "from upcycler.cli import main; main()"]
    return [*cli, "convert", str(src), str(out), "--to", to, *(["--shard-size", "2GB"] if to == "hf" else [])]


def drop_tensor_digests(orbax: Path) -> None:
    """Remove the per-tensor sha256 from an Orbax output's manifest: reading it then checks nothing."""
    manifest = orbax / "upcycler.json"
    data = json.loads(manifest.read_text())
    for record in data["tensors"].values():
        record.pop("sha256", None)
    manifest.write_text(json.dumps(data))


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = llama3_8b_config(args.scale)
    work = Path(tempfile.mkdtemp(prefix="upcycler-bench-io-", dir=args.workdir))
    try:
        src = work / "src"
        expected = family_for_config(config, "config.json").read_config(config).total_params() * 2
        free = shutil.disk_usage(work).free
        if free < 2.2 * expected:
            raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, need about {2.2 * expected / 1e9:.1f} GB "
                             f"(two checkpoints); free space or use a smaller --scale")
        t0 = time.perf_counter()
        nbytes = write_synthetic(src, config, shard_size=5 * 1000**3)
        generate_s = time.perf_counter() - t0
        log = work / "child.log"
        load_before = os.getloadavg()[0]
        names = ("copy", "hf_to_hf", "hf_checked", "hf_to_orbax", "orbax_to_hf", "orbax_unchecked",
                 *(("before_hf_to_hf", "before_hf_to_orbax", "before_orbax_to_hf") if args.before else ()))
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        copy, hf, again, orbax = work / "copy", work / "hf", work / "again", work / "orbax"
        for rep in range(args.repeat):
            copy_cmd = [sys.executable, __file__, "--copy", str(src), str(copy)]
            runs["copy"].append(measure(copy_cmd, src, copy, log))
            shutil.rmtree(copy)
            runs["hf_to_hf"].append(measure(convert(src, hf, "hf"), src, hf, log))
            if args.before:
                shutil.rmtree(hf)
                runs["before_hf_to_hf"].append(measure(convert(src, hf, "hf", args.before), src, hf, log))
            runs["hf_checked"].append(measure(convert(hf, again, "hf"), hf, again, log))
            shutil.rmtree(hf)
            shutil.rmtree(again)
            runs["hf_to_orbax"].append(measure(convert(src, orbax, "orbax"), src, orbax, log))
            if args.before:
                shutil.rmtree(orbax)
                runs["before_hf_to_orbax"].append(measure(convert(src, orbax, "orbax", args.before), src, orbax,
                                                          log))
            if rep == args.repeat - 1:
                shutil.rmtree(src)  # not needed any more: at most two checkpoints are on disk at a time
            runs["orbax_to_hf"].append(measure(convert(orbax, hf, "hf"), orbax, hf, log))
            shutil.rmtree(hf)
            if args.before:
                runs["before_orbax_to_hf"].append(measure(convert(orbax, hf, "hf", args.before), orbax, hf, log))
                shutil.rmtree(hf)
            drop_tensor_digests(orbax)
            runs["orbax_unchecked"].append(measure(convert(orbax, hf, "hf"), orbax, hf, log))
            shutil.rmtree(hf)
            shutil.rmtree(orbax)
        load_after = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    copy_s = statistics.median(r["seconds"] for r in runs["copy"])
    result: dict[str, Any] = {"shape": "llama-3-8b", "scale": args.scale, "bytes": nbytes,
                              "layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
                              "repeat": args.repeat, "generate_s": round(generate_s, 1)}
    ok = True
    for name, samples in runs.items():
        seconds = statistics.median(r["seconds"] for r in samples)
        rss = statistics.median(r["peak_rss_mb"] for r in samples)
        cpu = statistics.median(r["cpu_s"] for r in samples)
        entry = {"seconds": seconds, "gb_per_s": round(nbytes / seconds / 1e9, 3), "cpu_s": cpu,
                 "peak_rss_mb": rss}
        if name != "copy":
            entry["ratio"] = round(seconds / copy_s, 2)
            if not name.startswith("before_"):
                target = TARGET_RATIO_ORBAX if "orbax" in name else TARGET_RATIO
                ok = ok and entry["ratio"] <= target and rss < TARGET_RSS_MB
        result[name] = entry
    result["digest_cost_hf"] = round(result["hf_checked"]["seconds"] / result["hf_to_hf"]["seconds"], 3)
    result["digest_cost_orbax"] = round(result["orbax_to_hf"]["seconds"] / result["orbax_unchecked"]["seconds"], 3)
    result["targets"] = {"ratio": TARGET_RATIO, "ratio_orbax": TARGET_RATIO_ORBAX, "peak_rss_mb": TARGET_RSS_MB,
                         "met": ok}
    result["load_avg"] = [round(load_before, 1), round(load_after, 1)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply layers and widths (1 = 8B)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each measurement; medians reported")
    parser.add_argument("--workdir", default=None, help="where to write (default: the system temp directory)")
    parser.add_argument("--before", default=None, metavar="PYTHON",
                        help="also convert with this interpreter (an older upcycler) in the same rounds")
    parser.add_argument("--copy", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.copy:
        copy_tree(Path(args.copy[0]), Path(args.copy[1]))
        return
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
