"""Benchmark `prepare-data` against the tokenizer alone, and the train-time reader against a pod step's need.

    python bench/prepare_data.py [--gigabytes 1] [--workers 2] [--repeats 1] [--step-s S]

**Preparation.** A JSONL corpus of `--gigabytes` is generated from the bundled demo corpus (its documents,
each rewritten with words drawn from the bundled tokenizer's vocabulary so no two documents repeat) into
files of 256 MiB. Each round times, in fresh processes and interleaved:
- `ceiling_s`: `tokenizers`' `encode_batch` over the same documents, already parsed and in memory (not
  timed), in batches of 4096, with as many threads as the machine has cores (`RAYON_NUM_THREADS`), doing
  nothing with the ids: what tokenising alone costs here;
- `prepare_s`: `upcycle prepare-data --workers N` of the same files (Beam's DirectRunner), to the
  sharded format, every check on.
`ratio` = ceiling_s / prepare_s (1.0 = the preparation costs only the tokenising).

**Reading.** The prepared source is read by the trainer's data iterator as one host of the reference MoE
on v5e-256 reads it (`bench/configs/moe-13b-a2b-v5e-256.yaml`: 1024 × 4096 tokens per step over 64 hosts,
so 16 rows per host per step), `reader_tokens_per_s` per host. The step's need per host is the step's
tokens / 64 hosts / the compile report's roofline step time for that config (`--step-s`, else measured
by `upcycle continued-pretrain --compile-only --topology v5e-256 --json` here, about two minutes);
`reader_vs_need` = reader / need (target ≥ 10).

One JSON line: medians over `--repeats` rounds and each round's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "upcycler" / "data" / "demo"
TOKENIZER = DEMO / "tokenizer.json"
REFERENCE = REPO / "bench" / "configs" / "moe-13b-a2b-v5e-256.yaml"
HOSTS = 64  # v5e-256: 64 hosts of 4 chips
FILE_BYTES = 256 * 1024**2

_CEILING = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
docs = [json.loads(line)["text"] for path in sys.argv[2:] for line in open(path, "rb")]
start = time.perf_counter()
tokens = 0
for k in range(0, len(docs), 4096):
    tokens += sum(len(e.ids) for e in tok.encode_batch_fast(docs[k:k + 4096], add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--step-s", type=float, default=None, help="the reference step's roofline time")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prepare-bench-", dir=args.workdir))
    try:
        files = generate(work / "corpus", int(args.gigabytes * 1e9))
        rounds = [one_round(work, files, args.workers) for _ in range(args.repeats)]
        reader = read_rate(work / "out")
        step_s = args.step_s or roofline_step_s(work)
        need = 1024 * 4096 / HOSTS / step_s
        result = {
            "bench": "prepare_data", "corpus_bytes": sum(f.stat().st_size for f in files), "workers": args.workers,
            "ceiling_s": statistics.median(r["ceiling_s"] for r in rounds),
            "prepare_s": statistics.median(r["prepare_s"] for r in rounds),
            "ratio": statistics.median(r["ratio"] for r in rounds),
            "tokens": rounds[0]["tokens"],
            "reader_tokens_per_s": reader, "step_s": step_s, "need_tokens_per_s": need,
            "reader_vs_need": reader / need, "rounds": rounds,
        }
        print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def generate(directory: Path, size: int) -> list[Path]:
    """JSONL files of about `size` bytes in total: the demo corpus's documents, with words from the
    tokenizer's vocabulary mixed in so that every document is different."""
    from tokenizers import Tokenizer

    directory.mkdir(parents=True)
    docs = [json.loads(line)["text"] for path in sorted((DEMO / "corpus").glob("*.jsonl"))
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    vocab = sorted(w.replace("Ġ", " ").strip() for w in Tokenizer.from_file(str(TOKENIZER)).get_vocab())
    vocab = [w for w in vocab if w.isalpha()]
    rng = random.Random(0)
    files, written, number = [], 0, 0
    while written < size:
        path = directory / f"part-{number:04d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            while f.tell() < FILE_BYTES and written + f.tell() < size:
                words = rng.choice(docs).split()
                for k in rng.sample(range(len(words)), k=max(1, len(words) // 10)):
                    words[k] = rng.choice(vocab)
                f.write(json.dumps({"text": " ".join(words)}) + "\n")
            written += f.tell()
        files.append(path)
        number += 1
    return files


def one_round(work: Path, files: list[Path], workers: int) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": str(os.cpu_count())}
    ceiling = subprocess.run([sys.executable, "-c", _CEILING, str(TOKENIZER), *map(str, files)], env=env,
                             capture_output=True, text=True, check=True)
    measured = json.loads(ceiling.stdout)
    shutil.rmtree(work / "out", ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "upcycler", "prepare-data", "--tokenizer", str(TOKENIZER),
                    "--source", f"web={files[0].parent}/*.jsonl", "--out", str(work / "out"),
                    "--workers", str(workers)], env=env, capture_output=True, text=True, check=True)
    prepare_s = time.perf_counter() - start
    index = json.loads((work / "out" / "web.index.json").read_text())
    assert index["num_tokens"] == measured["tokens"] + index["num_documents"], "prepare-data and the ceiling disagree"
    return {"ceiling_s": measured["seconds"], "prepare_s": prepare_s, "ratio": measured["seconds"] / prepare_s,
            "tokens": index["num_tokens"], "shards": len(index["shards"])}


def read_rate(prepared: Path, steps: int = 200) -> float:
    """Tokens per second one host of the reference pod reads (16 rows of 4096 tokens per step)."""
    from upcycler.train.data.config import DataConfig, Phase
    from upcycler.train.data.mix import make_data_iterator

    config = DataConfig(dir=prepared, seq_len=4096, global_batch_size=1024, seed=0, phases=(Phase({"web": 1.0}),))
    iterator = make_data_iterator(config, process_index=7, process_count=HOSTS)
    next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    elapsed = time.perf_counter() - start
    iterator.close()
    return steps * 16 * 4096 / elapsed


def roofline_step_s(work: Path) -> float:
    """The reference config's roofline step time on v5e-256, from the compile-only report."""
    proc = subprocess.run([sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(REFERENCE),
                           "--compile-only", "--topology", "v5e-256", "--json", "--set", f"run_dir={work / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, check=True)
    return _find(json.loads(proc.stdout), "step_s")


def _find(value, key: str):
    if isinstance(value, dict):
        if key in value:
            return value[key]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found = _find(item, key)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    main()
