"""Fixtures for the trainer tests: a tokenizer trained on real text, prepared data, tiny checkpoints, configs.

Everything is small enough that a training step of the tiny models takes milliseconds: the tokenizer has
384 tokens, the sources are Python standard-library modules (real text), the models have width 32.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from cli_helpers import run_cli  # noqa: F401  (the trainer tests' `F.run_cli`)

VOCAB = 384
EOS = "<|endoftext|>"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = {
    "json": sorted((STDLIB / "json").glob("*.py")),
    "email": sorted((STDLIB / "email").glob("*.py"))[:8],
}


def train_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer of VOCAB tokens trained on the test sources; returns tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(f) for files in SOURCES.values() for f in files], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def prepare_data(out: Path, tokenizer: Path) -> Path:
    """Tokenise the test sources (`json`, `email`) into `out` with the project's prepare-data engine."""
    from upcycler.train.data.prepare import prepare_sources
    from upcycler.train.data.tokenizer import load_tokenizer

    prepare_sources(load_tokenizer(tokenizer), SOURCES, out, fmt="text")
    return out


def as_single_file(directory: Path) -> Path:
    """Rewrite every sharded source of `directory` in place in the single-file format of earlier versions
    (`NAME.tokens.npy` + `NAME.meta.json`), which the readers still accept; returns `directory`."""
    import shutil

    from upcycler.train.data.format import (
        INDEX_SUFFIX,
        META_SUFFIX,
        SHARD_HEADER_BYTES,
        TOKENS_SUFFIX,
        npy_header,
    )

    for index_path in sorted(directory.glob(f"*{INDEX_SUFFIX}")):
        index = json.loads(index_path.read_text())
        name, dtype = index["name"], np.dtype(index["dtype"])
        payload = b"".join((directory / s["file"]).read_bytes()[SHARD_HEADER_BYTES:] for s in index["shards"])
        (directory / f"{name}{TOKENS_SUFFIX}").write_bytes(npy_header(dtype, index["num_tokens"]) + payload)
        meta = {k: v for k, v in index.items() if k != "shards"} | {"format_version": 1,
                                                                    "tokens_file": f"{name}{TOKENS_SUFFIX}"}
        (directory / f"{name}{META_SUFFIX}").write_text(json.dumps(meta, indent=2) + "\n")
        index_path.unlink()
        shutil.rmtree(directory / f"{name}.shards")
    return directory


def tiny_spec(moe: bool = False, **changes: Any):
    """A width-32 llama (or a qwen3_moe with 4 experts, top-2, the first layer dense) over VOCAB tokens."""
    from upcycler.spec import ModelSpec, MoESpec

    base = {
        "family": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "max_position_embeddings": 256,
    }
    if moe:
        base.update(
            family="qwen3_moe",
            num_layers=3,
            dense_layers=(0,),
            qk_norm=True,
            moe=MoESpec(num_experts=4, top_k=2, expert_width=16),
        )
    base.update(changes)
    return ModelSpec(**base)


def write_model(out: Path, spec, tokenizer: Path | None = None, seed: int = 0) -> Path:
    """Random parameters of `spec` written as a Hugging Face checkpoint (with the tokenizer, if given)."""
    from upcycler.io import write_checkpoint
    from upcycler.io.checkpoint import Checkpoint
    from upcycler.train.model.params import init_params, to_tensors

    params = init_params(spec, jax.random.key(seed), std=0.05)
    side = (tokenizer,) if tokenizer is not None else ()
    ckpt = Checkpoint(spec=spec, tensors=to_tensors(spec, params), side_files=side)
    return write_checkpoint(ckpt, out, to="hf", progress=False)


def config_dict(tmp: Path, init: Path, data: Path, **changes: Any) -> dict[str, Any]:
    """A complete small training config; `changes` override top-level keys or dotted sub-keys."""
    cfg: dict[str, Any] = {
        "run_dir": str(tmp / "run"),
        "steps": 6,
        "model": {"init": str(init)},
        "data": {
            "dir": str(data),
            "seq_len": 32,
            "global_batch_size": 8,
            "seed": 0,
            "phases": [
                {"until_step": 3, "weights": {"json": 0.75, "email": 0.25}},
                {"weights": {"json": 0.5, "email": 0.5}},
            ],
        },
        "optimizer": {
            "lr": 3e-3,
            "weight_decay": 0.01,
            "schedule": [
                {"kind": "warmup", "until_step": 2},
                {"kind": "cosine", "until_step": 40, "lr": 3e-4},
            ],
        },
        "checkpoint": {"every": 2, "keep": 3, "async": True},
        "metrics": {"progress": False, "peak_flops": 1e11},
    }
    for key, value in changes.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg



REDUCTION_NOISE = 5e-5  # |Δ| of parameters trained 6 steps on another device layout, fp32 reduction order


def assert_same_training(params: dict[str, np.ndarray], reference: dict[str, np.ndarray], *, lr_bound: float,
                         outliers: float = 1e-4) -> None:
    """Parameters trained on another layout of devices or processes equal `reference` up to the order of
    fp32 reductions: every element within `REDUCTION_NOISE`, but for a rare few (at most a fraction
    `outliers` of all elements) whose gradient is itself at fp32's noise level. There Adam's update
    (m/√v: about ±lr whatever |g|) may change sign with the summation order, so such an element may differ
    by up to twice the learning rates summed over the steps (`lr_bound`). A lost or doubled update moves
    whole tensors or shards by about lr, far more elements than `outliers` allows. (Measured, a pod of 4
    processes against one process after 6 steps: every element within 4e-5 on JAX 0.10; on JAX 0.12 one
    element of 43,168 at 1.2e-4, an embedding entry, and every other within 5.2e-6.)"""
    diffs = np.concatenate([np.abs(params[k].astype(np.float64) - reference[k]).ravel() for k in reference])
    beyond = int((diffs > REDUCTION_NOISE).sum())
    assert beyond <= outliers * diffs.size and diffs.max() <= lr_bound, (
        f"{beyond} of {diffs.size:,} elements differ by more than {REDUCTION_NOISE} (the largest by "
        f"{diffs.max():.3g}); reduction order allows {outliers * diffs.size:.0f}, each within {lr_bound:.3g}")

def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_params(step_dir: Path) -> dict[str, np.ndarray]:
    """Every canonical tensor of a checkpoint step, as numpy, read through the public checkpoint reader."""
    from upcycler.io import read_checkpoint

    ckpt = read_checkpoint(step_dir)
    return {name: np.asarray(t.load()) for name, t in ckpt.tensors.items()}


_WORKSPACE: dict[str, Path] = {}


def workspace(root: Path) -> dict[str, Path]:
    """Tokenizer, prepared data and tiny checkpoints (dense llama, qwen3_moe), built once per pytest run."""
    if not _WORKSPACE:
        tok = train_tokenizer(root / "tokenizer")
        _WORKSPACE.update(
            root=root,
            tokenizer=tok,
            data=prepare_data(root / "data", tok),
            dense=write_model(root / "dense", tiny_spec(), tok),
            moe=write_model(root / "moe", tiny_spec(moe=True), tok),
        )
    return _WORKSPACE


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
