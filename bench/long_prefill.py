"""Benchmark FlexPrefill sparse prefill against dense attention on a real model (SmolLM2-135M-Instruct).

    python bench/long_prefill.py                                   # 8k, 16k, 32k; layers 2, 6, 10, 14
    python bench/long_prefill.py --lengths 4k --layers 2 --repeats 1 --min-budget 512    # under a minute
    python bench/long_prefill.py --model DIR --lengths 16k --no-end-to-end
    python bench/long_prefill.py --lengths 4k --layers 2 --repeats 1 --dense-above 1   # force the sparse path
    python bench/long_prefill.py --lengths 16k --layers 10 --save-qkv qkv-16k.npz      # keep the real inputs
    python bench/long_prefill.py --qkv qkv-16k.npz      # time them on another machine (no model needed)
    python bench/long_prefill.py --lengths 32k --topology v5e    # bound it on a TPU chip, compiled here

The model is a Hugging Face checkpoint directory (`--model`; default: the bf16 SmolLM2-135M-Instruct the
`real_model` tests build in `$UPCYCLER_TEST_CACHE`, default `~/.cache/upcycler-tests`; run
`pytest -m real_model` once to build it). Its weights run in fp32 (`ModelConfig().compute_dtype`) at the
highest matmul precision, as `upcycle eval` runs them. The prompt of every length N is a needle prompt of
exactly N tokens (`upcycler.train.evaluation.long_eval.needle_items`, seed 0: a passkey sentence in shuffled documents
of the bundled prose corpus, repeated as needed, then the question), tokenised with MODEL/tokenizer.json.

For each length, one JSON line with:

- `attention`, the attention op alone, on real inputs: the q, k, v of each `--layers` layer, captured by
  `PrefillModel.hidden(observe=...)` during one FlexPrefill prefill that stops right after the deepest
  layer's q/k/v (so layer i's inputs went through FlexPrefill in layers < i). On them, timed interleaved
  after one warm-up call of each (`time_round_robin` of bench/common.py; medians over `--repeats`):
  `flexprefill_attention` (selection, the host's bucket choice and the block-sparse attention, until its
  output is ready), the baseline `causal_attention_jit` (dense causal attention by chunks of queries: the
  model's own dense path in `PrefillModel`), and the selection alone (`select_blocks_jit`). Per
  layer: seconds, `ratio` = dense / flexprefill, `density` (the fraction of causal key blocks computed,
  mean over heads, from the Result: 1 when FlexPrefill fell back to dense), `selection_density` (what the
  selection kept, even when it then ran dense), `fallback`, query-aware heads, `rel_err` =
  max|sparse − dense| / max|dense| and `rel_err_mean` = mean|sparse − dense| / mean|dense| (over positions,
  heads and channels). Then the median ratio over layers.
- `end_to_end` (lengths ≤ 16k by default; `--end-to-end-all` for every length, `--no-end-to-end` for
  none; a dense prefill of 32k takes about half an hour on 2 cores): `PrefillModel.run(prompt, answer)`
  with dense attention (`attention: einsum`) and with FlexPrefill, interleaved after a warm-up of each,
  medians; KL(dense ‖ flexprefill) of the next-token distributions after the prompt (nats), whether their
  top-1 agree, whether greedy decoding retrieves the passkey with each, the mean density over layers and
  heads and the number of query-aware (layer, head) pairs.

`--save-qkv FILE` keeps the captured q, k, v (float16, one npz) and `--qkv FILE` times the attention op on
them without the model (no end-to-end), so a machine that cannot hold the model or build the prompt (an
accelerator host) still times real selections. Off CPU, `dot_product` (`jax.nn.dot_product_attention`,
causal, in bfloat16: the platform's fused dense attention, cuDNN's flash attention on a GPU) is timed
beside the model's own dense path (on a CPU it would materialise every score: skipped), and so is `device`:
FlexPrefill as `upcycle eval` runs it on that accelerator (`flexprefill_device`, the selection then the
platform's sparse kernel, forced, in bfloat16); `ratio_device_vs_dot_product` = dot_product / device.

`--topology v5e` (or v6e, v5p, v4) replaces the timing by bounds on one chip of that TPU, from executables
compiled here (`bench/prefill_roofline.py`): per layer the selection's and the kernels' FLOPs and bytes,
the roofline time of FlexPrefill (selection + splash kernel over the selected blocks) against dense splash
attention, their ratio and the kernels' grid steps; no end-to-end run.

Wall seconds and process CPU seconds are both reported (CPU seconds sum over threads), with the 1-minute
load average: the machine may be shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from common import time_round_robin

from upcycler.cli.demo import demo_assets
from upcycler.errors import UpcyclerError
from upcycler.train.config import ModelConfig
from upcycler.train.data.readers import read_documents
from upcycler.train.evaluation import long_eval
from upcycler.train.evaluation.config import PrefillConfig
from upcycler.train.evaluation.prefill import PrefillModel
from upcycler.train.model.flexprefill import (
    FlexPrefillOptions,
    causal_attention_jit,
    flexprefill_attention,
    select_blocks_jit,
)

REAL_MODEL = "smollm2-135m-instruct-bf16-v2"  # the directory tests/real_model.py `smollm2()` builds
END_TO_END_MAX = 16 * 1024  # longest length whose end-to-end prefill runs without --end-to-end-all
SEED = 0



def default_model() -> Path:
    """Where the `real_model` tests keep SmolLM2-135M-Instruct (tests/real_model.py `cache_dir()`)."""
    cache = Path(os.environ.get("UPCYCLER_TEST_CACHE", Path.home() / ".cache" / "upcycler-tests"))
    return cache / REAL_MODEL


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help=f"HF checkpoint directory (default: $UPCYCLER_TEST_CACHE/{REAL_MODEL})")
    parser.add_argument("--lengths", default="8k,16k,32k", help="prompt lengths in tokens (k = 1024)")
    parser.add_argument("--layers", default="2,6,10,14", help="layers whose attention op is timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=float, default=0.95)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--min-budget", type=int, default=1024)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--dense-above", type=float, default=PrefillConfig().prefill_dense_above,
                        help="selection density above which a layer runs dense (1: always sparse)")
    parser.add_argument("--end-to-end", action=argparse.BooleanOptionalAction, default=True,
                        help=f"time whole prefills too, for lengths <= {END_TO_END_MAX} (default: on)")
    parser.add_argument("--save-qkv", type=Path, default=None, help="keep the captured q, k, v in this npz")
    parser.add_argument("--qkv", type=Path, default=None, help="time the attention op on a --save-qkv file")
    parser.add_argument("--topology", default=None,
                        help="a TPU generation (v5e, v6e, v5p, v4): instead of timing here, bound the attention "
                             "on one chip from compiled executables (bench/prefill_roofline.py)")
    parser.add_argument("--end-to-end-all", action="store_true",
                        help="time whole prefills at every length (a dense 32k prefill takes ~30 min)")
    args = parser.parse_args()
    try:
        args.lengths = long_eval.parse_lengths(args.lengths)
    except UpcyclerError as err:
        parser.error(str(err))
    try:
        args.layers = sorted({int(x) for x in args.layers.split(",")})
    except ValueError:
        parser.error(f"--layers: {args.layers!r} is not a comma-separated list of layer indices")
    if args.qkv is not None:
        return args
    if args.model is None:
        args.model = default_model()
        if not (args.model / "model.safetensors").is_file():
            parser.error(f"no model at {args.model}; build it once with `pytest -m real_model` "
                         "(tests/real_model.py) or pass --model DIR")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def prompt(model: Path, length: int) -> tuple[np.ndarray, np.ndarray]:
    """A needle prompt of exactly `length` tokens in the bundled prose corpus, and its answer's ids."""
    tokenizer, _ = long_eval.load_tokenizer(long_eval.tokenizer_file(model))
    documents = list(read_documents(demo_assets() / "corpus" / "prose.train.jsonl", "jsonl"))
    item = long_eval.needle_items(tokenizer, documents, [length], 1, SEED)[0]
    return item.ids, item.answer


class _Captured(Exception):
    """Raised from `observe` once the deepest wanted layer's q, k, v are in hand: the prefill stops."""


def capture_qkv(model: PrefillModel, ids: np.ndarray, layers: list[int]) -> dict[int, tuple[jax.Array, ...]]:
    """The prompt's attention inputs (q, k, v) of `layers`, from a prefill stopped after the deepest."""
    qkv: dict[int, tuple[jax.Array, ...]] = {}

    def observe(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
        if layer in layers:
            qkv[layer] = jax.block_until_ready((q, k, v))
        if layer == layers[-1]:
            raise _Captured

    try:
        model.hidden(ids, np.zeros(0, np.int32), observe=observe)
    except _Captured:
        pass
    return qkv


def save_qkv(path: Path, length: int, qkv: dict[int, tuple[jax.Array, ...]]) -> None:
    """`qkv` as float16 arrays `q<layer>`, `k<layer>`, `v<layer>` in one npz, with the prompt length."""
    arrays = {f"{name}{layer}": np.asarray(x, np.float16)
              for layer, xs in qkv.items() for name, x in zip("qkv", xs, strict=True)}
    np.savez(path, length=length, **arrays)


def load_qkv(path: Path) -> tuple[int, dict[int, tuple[jax.Array, ...]]]:
    """The prompt length and per-layer float32 (q, k, v) a `save_qkv` file holds."""
    with np.load(path) as data:
        layers = sorted(int(name[1:]) for name in data.files if name.startswith("q"))
        qkv = {layer: tuple(jax.numpy.asarray(data[f"{n}{layer}"], np.float32) for n in "qkv") for layer in layers}
        return int(data["length"]), qkv


def fused_dense(q, k, v):
    """Causal attention by the platform's fused kernel (`jax.nn.dot_product_attention` in bfloat16), [N, H, h]."""
    q, k, v = (x.astype(jax.numpy.bfloat16)[None] for x in (q, k, v))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)[0]


fused_dense_jit = jax.jit(fused_dense)


def device_flexprefill(q, k, v, opts: FlexPrefillOptions):
    """FlexPrefill as the device prefill runs it on this accelerator (`flexprefill_device`: the selection,
    then the platform's sparse kernel, forced), in bfloat16 like `fused_dense`, [N, H, h]."""
    from upcycler.train.model.flexprefill_device import flexprefill_attention

    q, k, v = (x.astype(jax.numpy.bfloat16)[None] for x in (q, k, v))
    forced = dataclasses.replace(opts, kernel="sparse", dense_above=1.0)
    return flexprefill_attention(q, k, v, forced, platform=jax.default_backend()).out_BNHh[0]


device_flexprefill_jit = jax.jit(device_flexprefill, static_argnames="opts")


def keeping(outputs: dict, name: str, fn: Callable) -> Callable:
    """`fn`, its last result kept in `outputs[name]` (the timed calls also give the outputs compared)."""

    def call(*args):
        outputs[name] = fn(*args)
        return outputs[name]

    return call


def attention_op(qkv: dict[int, tuple[jax.Array, ...]], opts: FlexPrefillOptions, repeats: int) -> dict:
    """FlexPrefill against dense causal attention on each layer's q, k, v (module docstring)."""
    outputs: dict = {}
    calls = {}
    for layer, (q, k, v) in qkv.items():
        calls[f"flexprefill/{layer}"] = (keeping(outputs, f"flexprefill/{layer}", flexprefill_attention),
                                         (q, k, v, opts))
        calls[f"dense/{layer}"] = (keeping(outputs, f"dense/{layer}", causal_attention_jit), (q, k, v))
        if jax.default_backend() != "cpu":
            calls[f"dot_product/{layer}"] = (fused_dense_jit, (q, k, v))
            calls[f"device/{layer}"] = (lambda q, k, v: device_flexprefill_jit(q, k, v, opts), (q, k, v))
        calls[f"select/{layer}"] = (keeping(outputs, f"select/{layer}", lambda q, k: select_blocks_jit(q, k, opts)),
                                    (q, k))
    with jax.default_matmul_precision("highest"):  # as PrefillModel runs the layers
        times = time_round_robin(calls, repeats)

    per_layer = {}
    for layer, (q, _, _) in qkv.items():
        sparse, dense, selection = (outputs[f"{kind}/{layer}"] for kind in ("flexprefill", "dense", "select"))
        t = {kind: times[f"{kind}/{layer}"] for kind in ("flexprefill", "dense", "select", "dot_product", "device")
             if f"{kind}/{layer}" in times}
        nb = opts.blocks(q.shape[0])
        selected = np.asarray(selection.mask_Hnn.sum((-2, -1))) / (nb * (nb + 1) / 2)
        out_sparse, out_dense = np.asarray(sparse.out_NHh), np.asarray(dense)
        per_layer[str(layer)] = {
            "seconds": {kind: round(t[kind]["wall"], 4) for kind in t},
            "cpu_seconds": {kind: round(t[kind]["cpu"], 3) for kind in t},
            "ratio": round(t["dense"]["wall"] / t["flexprefill"]["wall"], 3),
            **({"ratio_dot_product": round(t["dot_product"]["wall"] / t["flexprefill"]["wall"], 3),
                "ratio_device_vs_dot_product": round(t["dot_product"]["wall"] / t["device"]["wall"], 3)}
               if "dot_product" in t else {}),
            "density": round(float(np.mean(sparse.density_H)), 4),
            "selection_density": round(float(selected.mean()), 4),
            "fallback": bool(opts.runs_dense(q.shape[0]) or selected.mean() > opts.dense_above),
            "query_aware_heads": int(np.sum(sparse.query_aware_H)),
            "rel_err": float(np.abs(out_sparse - out_dense).max() / np.abs(out_dense).max()),
            "rel_err_mean": float(np.abs(out_sparse - out_dense).mean() / np.abs(out_dense).mean()),
        }
    ratios = [entry["ratio"] for entry in per_layer.values()]
    return {"per_layer": per_layer, "median_ratio": round(statistics.median(ratios), 3)}


def end_to_end(flex: PrefillModel, ids: np.ndarray, answer: np.ndarray, repeats: int) -> dict:
    """Whole prefills (`PrefillModel.run`), dense against FlexPrefill, and how far their outputs differ."""
    dense = PrefillModel(flex.spec, flex.params, dataclasses.replace(flex.cfg, attention="einsum"))
    outputs: dict = {}
    calls = {name: (keeping(outputs, name, model.run), (ids, answer))
             for name, model in (("dense", dense), ("flexprefill", flex))}
    times = time_round_robin(calls, repeats)
    p_log = long_eval.log_softmax(outputs["dense"].last_logits)
    q_log = long_eval.log_softmax(outputs["flexprefill"].last_logits)
    stats = outputs["flexprefill"].stats
    return {
        "seconds": {name: round(t["wall"], 3) for name, t in times.items()},
        "cpu_seconds": {name: round(t["cpu"], 2) for name, t in times.items()},
        "ratio": round(times["dense"]["wall"] / times["flexprefill"]["wall"], 3),
        "kl": float(np.sum(np.exp(p_log) * (p_log - q_log))),
        "top1_agree": bool(np.argmax(p_log) == np.argmax(q_log)),
        "retrieves": {name: long_eval.greedy_retrieves(out.last_logits, out.answer_logits, answer)
                      for name, out in outputs.items()},
        "mean_density": round(float(stats.density.mean()), 4),
        "query_aware_heads": int(stats.query_aware.sum()),
    }


def tpu_bounds(qkv: dict[int, tuple[jax.Array, ...]], opts: FlexPrefillOptions, topology: str) -> dict:
    """`prefill_roofline.layer_bound` of each layer, and the median ratio and mean density over them."""
    from prefill_roofline import layer_bound

    chip = topology.split("-")[0].split(":")[0]
    compiled: dict = {}
    per_layer = {str(layer): layer_bound(q, k, opts, chip, compiled) for layer, (q, k, _) in qkv.items()}
    return {"chip": chip, "per_layer": per_layer,
            "median_ratio": round(statistics.median(e["ratio"] for e in per_layer.values()), 3),
            "mean_density": round(float(np.mean([e["density"] for e in per_layer.values()])), 4)}


def main() -> None:
    args = parse_args()
    cfg = ModelConfig(attention="flexprefill")
    prefill = PrefillConfig(prefill_gamma=args.gamma, prefill_tau=args.tau, prefill_min_budget=args.min_budget,
                            prefill_block=args.block, prefill_dense_above=args.dense_above)
    if args.qkv is not None:
        length, qkv = load_qkv(args.qkv)
        options = prefill.options()
        print(json.dumps({
            "bench": "long_prefill", "length": length, "qkv": args.qkv.name, "layers": sorted(qkv),
            "device": jax.devices()[0].platform, "options": dataclasses.asdict(options),
            "dtype": "float32 (inputs stored as float16)", "repeats": args.repeats,
            **({"tpu": tpu_bounds(qkv, options, args.topology)} if args.topology
               else {"attention": attention_op(qkv, options, args.repeats)}),
            "load_1min": os.getloadavg()[0],
        }), flush=True)
        return
    model = PrefillModel.load(args.model, cfg, prefill=prefill)
    if args.layers[0] < 0 or args.layers[-1] >= model.spec.num_layers:
        sys.exit(f"--layers: the model has layers 0..{model.spec.num_layers - 1}, not {args.layers}")
    for length in args.lengths:
        ids, answer = prompt(args.model, length)
        start = time.perf_counter()
        qkv = capture_qkv(model, ids, args.layers)
        capture_s = time.perf_counter() - start
        if args.save_qkv is not None:
            save_qkv(args.save_qkv, length, qkv)
        result = {
            "bench": "long_prefill", "length": length, "model": str(args.model), "layers": args.layers,
            "options": dataclasses.asdict(model.options), "dtype": cfg.compute_dtype, "repeats": args.repeats,
            "capture_s": round(capture_s, 2),
            **({"tpu": tpu_bounds(qkv, model.options, args.topology)} if args.topology
               else {"attention": attention_op(qkv, model.options, args.repeats)}),
        }
        del qkv
        if args.end_to_end and not args.topology and (length <= END_TO_END_MAX or args.end_to_end_all):
            result["end_to_end"] = end_to_end(model, ids, answer, args.repeats)
        result["load_1min"] = os.getloadavg()[0]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
