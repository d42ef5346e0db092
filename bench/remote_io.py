"""Benchmark surgery with the model in a bucket (gs:// → gs://) against the same job on local disks, and a
resume's time to first step on a simulated pod.

    python bench/remote_io.py [--scale 0.5] [--repeats 3] [--workdir DIR]
    python bench/remote_io.py --only resume --processes 4 --repeats 3
    python bench/remote_io.py --only download --object-mb 512 --repeats 3
    python bench/remote_io.py --only tokens --repeats 5

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

`resume`: the demo's MoE (`upcycle dense-to-moe` of the bundled model, written to the bucket) trained from
data prepared into the bucket, to a run_dir in the bucket, by a simulated pod: `--processes` processes × 2
CPU devices, each with its own working directory, HOME, temporary and cache directories, sharing only the
bucket. Each round: a fresh run of one step (`fresh_s`: start, initialise, compile, one step, save), then a
run of `--steps` steps in another run_dir, then that run resumed for one more step (`resume_s`: start,
restore the parameters, optimiser state and data position from the bucket, compile, one step, save).
Every figure is the wall time of the whole pod (launch to the last process's exit); `ratio` = resume /
fresh is what restoring from the bucket adds to a start.

`download`: what checking every byte read from a bucket costs. One object of `--object-mb` random bytes
in the emulator is read into a local file `--repeats` times each way, interleaved: `unchecked_s` by
gcsfs's own `get` (what a bucket source was mirrored with before, unchecked: ranged reads 4 at a time
above 100 MB), `checked_s` by `object_store.download_checked` (one stream, its CRC32C computed as the
bytes arrive and compared with the bucket's) and `single_stream_s` by gcsfs in one stream, unchecked (the
same transfer as the checked one, without the hashing). One JSON line: the medians, `ratio` (checked /
unchecked), `stream_ratio` (checked / single stream: what the check itself adds) and `crc32c_s`, the time
google-crc32c takes over the same bytes in memory (the hashing alone).

`tokens`: what checking the token blocks of a prepared source costs a training run's reads. One shard of
`--shard-mb` MB of random uint32 ids, with its blocks' CRC32C (`format.BlockChecksums`, 256 KiB blocks), is
read in batches of `--batch` windows of 4,097 tokens at random offsets (a 4k-token run's examples), from the
bucket and from a local file, each way interleaved `--repeats` rounds: `unchecked_s` reads exactly the
windows (the shard described without its checksums, as an index of an earlier version is read) and
`checked_s` reads the whole blocks they fall in and checks each (the blocks kept from earlier reads emptied
before each round). One JSON line per place: the medians per batch, `ratio` (checked / unchecked) and the
bytes each way reads (`amplification`).
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
from surgery import llama_spec, run_child

from upcycler.cli.demo import _train_config, demo_assets
from upcycler.io import object_store

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from gcs_emulator import start, stop
from trainer_fixtures import free_port
from xla_flags import with_devices

DEMO_MOE = ["--experts", "24", "--topk", "6", "--granularity", "8", "--shared-experts", "2", "--dense-layers", "1",
            "--target", "qwen2_moe", "--seed", "0"]  # the demo's upcycling (upcycler/cli/demo.py)

BUCKET = "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", choices=("surgery", "resume", "download", "tokens"), default=None, help="run one part only")
    parser.add_argument("--processes", type=int, default=4, help="resume: processes of the simulated pod")
    parser.add_argument("--steps", type=int, default=4, help="resume: steps trained before the resume")
    parser.add_argument("--object-mb", type=int, default=512, help="download: the object's size in MB")
    parser.add_argument("--shard-mb", type=int, default=256, help="tokens: the shard's size in MB")
    parser.add_argument("--batch", type=int, default=64, help="tokens: windows read together")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="upcycler-bench-remote-", dir=args.workdir))
    emulator, url = start(BUCKET)
    os.environ.update(STORAGE_EMULATOR_HOST=url, UPCYCLER_CACHE=str(work / "cache"))
    try:
        if args.only in (None, "download"):
            print(json.dumps(checked_download(work, args.object_mb, args.repeats)), flush=True)
        if args.only in (None, "tokens"):
            for line in checked_tokens(work, args.shard_mb, args.batch, args.repeats):
                print(json.dumps(line), flush=True)
        if args.only in (None, "resume"):
            print(json.dumps(pod_resume(work, args.processes, args.steps, args.repeats)), flush=True)
        if args.only in (None, "surgery"):
            surgery_rounds(work, args.scale, args.repeats)
    finally:
        stop(emulator)
        shutil.rmtree(work, ignore_errors=True)


def surgery_rounds(work: Path, scale: float, repeats: int) -> None:
    """convert and dense-to-moe, local → local against gs:// → gs:// (module docstring); one JSON line each."""
    spec = llama_spec(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64,
                      vocab=128256, tied=True, scale=scale)
    source = work / "source"
    write_synthetic(spec, source)
    remote_source = f"gs://{BUCKET}/source"
    run_child(["convert", str(source), remote_source, "--no-verify"])  # upload once, untimed
    jobs = {"convert": ["convert", "{src}", "{out}"],
            "dense-to-moe": ["dense-to-moe", "{src}", "{out}", "--experts", "8", "--topk", "2"]}
    rounds: dict[str, list[dict]] = {name: [] for name in jobs}
    for k in range(repeats):
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
        print(json.dumps({"bench": f"remote_io/{name}", "source_bytes": source_bytes, "repeats": repeats,
                          **{k: round(v, 3) if k.endswith("_s") else v for k, v in median.items()},
                          "ratio": round(median["remote_s"] / median["local_s"], 3),
                          "rss_ratio": round(median["remote_rss"] / median["local_rss"], 3),
                          "rounds": runs}), flush=True)


def checked_download(work: Path, object_mb: int, repeats: int) -> dict:
    """A large object read unchecked (gcsfs) against checked (`download_checked`): medians and every round."""
    import google_crc32c

    data = os.urandom(object_mb * 1_000_000)
    url, local = f"gs://{BUCKET}/download/object.bin", work / "object.bin"
    object_store.write_bytes(url, data)
    listed, fs, key = object_store.object_info(url), object_store.filesystem(), url.split("://", 1)[1]
    started = time.perf_counter()
    google_crc32c.Checksum(data)
    crc32c_s = time.perf_counter() - started
    del data
    rounds = []
    for _ in range(repeats):
        figures = {}
        for name, read in (("unchecked_s", lambda: fs.get(key, str(local))),
                           ("single_stream_s", lambda: fs.get(key, str(local), concurrency=1)),
                           ("checked_s", lambda: object_store.download_checked([(url, listed, local)]))):
            local.unlink(missing_ok=True)
            started = time.perf_counter()
            read()
            figures[name] = round(time.perf_counter() - started, 3)
        rounds.append(figures)
    median = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    return {"bench": "remote_io/download", "object_bytes": listed.size, "repeats": repeats, **median,
            "ratio": round(median["checked_s"] / median["unchecked_s"], 3),
            "stream_ratio": round(median["checked_s"] / median["single_stream_s"], 3),
            "crc32c_s": round(crc32c_s, 3), "rounds": rounds}


def checked_tokens(work: Path, shard_mb: int, batch: int, repeats: int) -> list[dict]:
    """Random windows of a shard read with and without its block checks, in the bucket and locally."""
    import base64
    import random

    import numpy as np

    from upcycler.train.data import token_store
    from upcycler.train.data.format import BLOCK_BYTES, BlockChecksums, shard_header

    ids = np.random.default_rng(0).integers(0, 128_000, shard_mb * 250_000, dtype=np.uint32)
    checksums = BlockChecksums()
    checksums.update(ids.tobytes())
    header = shard_header(np.dtype(np.uint32), ids.size, 1, "0" * 64)
    local, url = work / "shard.tokens", f"gs://{BUCKET}/tokens/shard.tokens"
    local.write_bytes(header + ids.tobytes())
    object_store.upload_all([(local, url)])
    window, spans = 4097, random.Random(0)
    lines = []
    for where, location in (("bucket", url), ("local", str(local))):
        plain = token_store.ShardFile(location, header, ids.size, 4, "bench.index.json")
        checked = token_store.ShardFile(location, header, ids.size, 4, "bench.index.json",
                                        (BLOCK_BYTES, base64.b64decode(checksums.text())))
        rounds = []
        for _ in range(repeats):
            starts = [spans.randrange(ids.size - window) for _ in range(batch)]
            wanted = [(a, a + window) for a in starts]
            figures = {}
            for name, shard in (("unchecked_s", plain), ("checked_s", checked)):
                token_store._CHECKED._blocks.clear()
                stream = token_store.TokenStream([shard], np.dtype(np.uint32))
                began = time.perf_counter()
                got = stream.read_spans(wanted)
                figures[name] = round(time.perf_counter() - began, 4)
                assert all(np.array_equal(g, ids[a:b]) for g, (a, b) in zip(got, wanted))
            blocks = {k for a, b in wanted for k in range(a * 4 // BLOCK_BYTES, (b * 4 - 1) // BLOCK_BYTES + 1)}
            figures["amplification"] = round(len(blocks) * BLOCK_BYTES / (batch * window * 4), 1)
            rounds.append(figures)
        median = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
        lines.append({"bench": f"remote_io/tokens-{where}", "shard_bytes": ids.nbytes, "batch": batch,
                      "window_tokens": window, "repeats": repeats, **median,
                      "ratio": round(median["checked_s"] / median["unchecked_s"], 3), "rounds": rounds})
    return lines


def pod_resume(work: Path, processes: int, steps: int, repeats: int) -> dict:
    """Fresh start against resume on the simulated pod (module docstring): medians and every round."""
    root = f"gs://{BUCKET}/pod"
    assets = demo_assets()
    run_child(["dense-to-moe", str(assets / "model"), f"{root}/moe", *DEMO_MOE])
    corpus = assets / "corpus"
    run_child(["prepare-data", "--tokenizer", str(assets / "model" / "tokenizer.json"), "--out", f"{root}/data",
               *[a for name in ("code", "prose", "math") for a in ("--source", f"{name}={corpus / f'{name}.train.jsonl'}")]])
    rounds = []
    for k in range(repeats):
        fresh = run_pod(work / f"fresh-{k}", f"{root}/fresh-{k}", root, processes, steps=1)
        run_pod(work / f"run-{k}", f"{root}/run-{k}", root, processes, steps=steps)
        resumed = run_pod(work / f"resume-{k}", f"{root}/run-{k}", root, processes, steps=steps + 1)
        rounds.append({"fresh_s": round(fresh, 2), "resume_s": round(resumed, 2)})
    fresh_s, resume_s = (statistics.median(r[key] for r in rounds) for key in ("fresh_s", "resume_s"))
    return {"bench": "remote_io/resume", "processes": processes, "devices_per_process": 2, "resumed_at": steps,
            "repeats": repeats, "fresh_s": fresh_s, "resume_s": resume_s, "ratio": round(resume_s / fresh_s, 3),
            "rounds": rounds}


def run_pod(folder: Path, run_dir: str, root: str, processes: int, steps: int) -> float:
    """`continued-pretrain` of the demo's MoE on `processes` simulated hosts to `steps`; the pod's wall time."""
    port = free_port()
    procs = []
    started = time.perf_counter()
    for i in range(processes):
        host = folder / f"host{i}"
        (host / "tmp").mkdir(parents=True)
        config = _train_config(host, Path("unused"), 60, Path("unused"))  # the demo's 60-step schedule
        env = {**os.environ, "XLA_FLAGS": with_devices(2), "HOME": str(host), "TMPDIR": str(host / "tmp"),
               "UPCYCLER_CACHE": str(host / "cache")}
        sets = {"run_dir": run_dir, "model.init": f"{root}/moe", "model.tokenizer": f"{root}/moe/tokenizer.json",
                "data.dir": f"{root}/data", "metrics.progress": "false", "checkpoint.every": "100"}
        command = [sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(config),
                   "--steps", str(steps), "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                   "--process-id", str(i),
                   *[a for key, value in sets.items() for a in ("--set", f"{key}={value}")]]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=host))
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"pod process failed ({proc.returncode}): {err[-2000:]}")
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
