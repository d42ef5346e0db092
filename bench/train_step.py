"""Benchmark one training step of a small MoE on this machine: tokens/s and MFU against a measured peak.

    python bench/train_step.py            # 4 layers, d 512, 64 experts of width 256, top-8
    python bench/train_step.py --small    # a seconds-long smoke run
    python bench/train_step.py --model bench/configs/models/moe-13b-a2b --layers 4 --seq-len 4096 \
        --batch 8 --compute-dtype bfloat16 --weights-dtype bfloat16 --attention dot_product --remat full \
        --paths dropless                  # the reference MoE's layers, cut to 4, on an accelerator

Each path (the dropless sort + grouped-matmul MoE, and the one-hot reference that runs every expert on
every token) is built by the trainer's own `run_build.build` (same mesh, shardings, donation and
optimiser) and timed over `--steps` steps after a warm-up step. The peak is measured in the same run, right
before every timed step (the best of three large fp32 matmuls, `--peak-size`), so a machine shared with
other work is compared with itself under the same load. The peak matmul runs in the compute dtype
(`--compute-dtype`), so a bf16 step is compared with a bf16 peak. `mfu` is the median over steps of
(model FLOPs / step time) / that step's peak; `mfu_best_peak` divides the median step by the best peak
seen. Model FLOPs are the trainer's analytical count (`upcycler.train.reporting.flops.flops_per_token`: 6 × active
matmul parameters plus causal attention), so the one-hot path's wasted expert FLOPs are not useful work.

`--model DIR` takes the architecture from an HF config.json instead (weights are random), `--layers N`
keeps its first N layers: the reference MoE's layer shapes at a size one accelerator holds. A dense model
(no `moe` in its spec) has one path, reported as `dense`.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import fields
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.io.hf_read import read_spec
from upcycler.spec import ModelSpec, MoESpec
from upcycler.train import model as model_lib
from upcycler.train.config import TrainConfig
from upcycler.train.loop import run_build
from upcycler.train.loop.train_step import TrainState, global_batch
from upcycler.train.model.params import init_params
from upcycler.train.reporting.flops import flops_per_token


def bench_spec(small: bool) -> ModelSpec:
    """The benchmarked MoE: every layer routed, no shared expert, untied head."""
    if small:
        return ModelSpec(
            family="qwen3_moe",
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            head_dim=16,
            intermediate_size=128,
            qk_norm=True,
            moe=MoESpec(num_experts=8, top_k=2, expert_width=32),
        )
    return ModelSpec(
        family="qwen3_moe",
        vocab_size=8192,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=2048,
        qk_norm=True,
        moe=MoESpec(num_experts=64, top_k=8, expert_width=256),
    )


def spec_from_config(model: Path, layers: int | None) -> ModelSpec:
    """The architecture of an HF directory's config.json, cut to its first `layers` layers."""
    spec = read_spec(model)
    if layers is None or layers >= spec.num_layers:
        return spec
    changes: dict = {"num_layers": layers, "dense_layers": tuple(i for i in spec.dense_layers if i < layers)}
    if spec.layer_types is not None:
        changes["layer_types"] = spec.layer_types[:layers]
    return spec.replace(**changes)


class MatmulPeak:
    """FLOP/s of a jitted `size`×`size` matmul in `dtype` on the default device, measured on demand."""

    def __init__(self, size: int, dtype: str = "float32"):
        self.size = size
        self.a = jax.random.normal(jax.random.key(1), (size, size), dtype)
        self.b = jax.random.normal(jax.random.key(2), (size, size), dtype)
        self.mm = jax.jit(jnp.matmul)
        self.mm(self.a, self.b).block_until_ready()
        self.best = 0.0

    def __call__(self, repeats: int = 3) -> float:
        """The best of `repeats` matmuls now (and remember the best ever seen)."""
        fastest = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.mm(self.a, self.b).block_until_ready()
            fastest = min(fastest, time.perf_counter() - t0)
        now = 2.0 * self.size**3 / fastest
        self.best = max(self.best, now)
        return now


def _run_config(cfg: model_lib.ModelConfig, batch: int, seq_len: int) -> TrainConfig:
    """A training config running `cfg` on `batch` × `seq_len` tokens of one source, FSDP over every device,
    the optimiser at lr 1e-4 (the model's architecture comes from the spec given beside it)."""
    return TrainConfig.from_dict({
        "run_dir": "runs/bench", "steps": 1,
        "model": {"init": "random-weights", **{f.name: getattr(cfg, f.name) for f in fields(cfg)}},
        "data": {"dir": "data", "seq_len": seq_len, "global_batch_size": batch, "phases": [{"weights": {"data": 1.0}}]},
        "optimizer": {"lr": 1e-4}, "mesh": {"data": 1, "fsdp": -1, "context": 1, "expert": 1},
    }, "bench")


def bench_path(
    spec: ModelSpec, cfg: model_lib.ModelConfig, batch: int, seq_len: int, steps: int, peak: MatmulPeak
) -> dict:
    """Compile and time the train step under `cfg` (one MoE implementation), probing the peak before every step.
    The step is the trainer's own (`run_build.build`: mesh, layout, optimiser, step) on random weights."""
    built = run_build.build(_run_config(cfg, batch, seq_len), spec)
    shardings = built.layout.shardings
    params = jax.jit(lambda k: init_params(spec, k), out_shardings=shardings.params)(jax.random.key(0))
    state = TrainState(jnp.asarray(0, jnp.int32), params,
                       jax.jit(built.layout.tx.init, out_shardings=shardings.opt_state)(params))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, spec.vocab_size, size=(batch, seq_len + 1), dtype=np.int32)
    local = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "mask": np.ones((batch, seq_len), np.float32),
        "source_id": np.zeros(batch, np.int32),
    }
    data = global_batch(local, built.mesh)
    t0 = time.perf_counter()
    compiled = built.compile(state, data)
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    flops = flops_per_token(spec, seq_len) * batch * seq_len
    times, mfus = [], []
    for _ in range(steps):
        probe = peak() * jax.device_count()
        t0 = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        mfus.append(flops / times[-1] / probe)
    step_s = statistics.median(times)
    return {
        "step_s": round(step_s, 4),
        "tokens_per_s": round(batch * seq_len / step_s, 1),
        "mfu": round(statistics.median(mfus), 4),
        "compile_s": round(compile_s, 1),
        "loss": round(float(metrics["loss"]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model, for a quick smoke run")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--peak-size", type=int, default=None, help="matmul size for the peak measurement")
    parser.add_argument("--paths", default="dropless,onehot", help="comma-separated: dropless, onehot")
    parser.add_argument("--model", type=Path, default=None, help="an HF directory: its config.json's architecture")
    parser.add_argument("--layers", type=int, default=None, help="with --model: keep the first N layers")
    defaults = model_lib.ModelConfig()
    for option in ("compute_dtype", "weights_dtype", "attention", "remat", "gmm_backend"):
        parser.add_argument("--" + option.replace("_", "-"), default=getattr(defaults, option))
    args = parser.parse_args()
    spec = spec_from_config(args.model, args.layers) if args.model else bench_spec(args.small)
    batch = args.batch or (4 if args.small else 16)
    seq_len = args.seq_len or (32 if args.small else 256)
    steps = args.steps or (3 if args.small else 5)
    # an accelerator's matmul needs a large product to reach its peak (2048 on an H200 gave a sixth of it)
    peak_size = args.peak_size or (512 if args.small else 2048 if jax.default_backend() == "cpu" else 8192)
    peak = MatmulPeak(peak_size, args.compute_dtype)
    flops_step = flops_per_token(spec, seq_len) * batch * seq_len
    out: dict = {
        "bench": "train_step",
        "device": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "model": {
            "layers": spec.num_layers,
            "d_model": spec.hidden_size,
            "experts": spec.moe.num_experts if spec.moe else None,
            "top_k": spec.moe.top_k if spec.moe else None,
            "expert_width": spec.moe.expert_width if spec.moe else None,
            "vocab": spec.vocab_size,
            "active_params": spec.active_params(),
            "total_params": spec.total_params(),
        },
        "batch": batch,
        "seq_len": seq_len,
        "model_flops_per_step": flops_step,
        "config": {o: getattr(args, o) for o in ("compute_dtype", "weights_dtype", "attention", "remat", "gmm_backend")},
    }
    impl = {"dropless": "dropless", "onehot": "reference", "dense": "dropless"}
    paths = args.paths.split(",") if spec.moe else ["dense"]  # a dense model has one path
    for name in paths:
        cfg = model_lib.ModelConfig(moe_impl=impl[name], **out["config"])
        out[name] = bench_path(spec, cfg, batch, seq_len, steps, peak)
    out["peak_flops"] = round(peak.best / 1e9, 2) * 1e9
    for name in paths:
        best = flops_step / out[name]["step_s"] / (peak.best * jax.device_count())
        out[name]["mfu_best_peak"] = round(best, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
