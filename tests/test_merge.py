"""Merging: every method against a numpy reference written here, MoE per expert, Orbax, run directories,
memory that does not grow with the number of inputs, and the refusals of `upcycle merge`.

References read the safetensors files with `safetensors.numpy` and compute in float64, independently
of upcycler; merged outputs are written to disk and read back the same way.
"""

from __future__ import annotations

import json
import shutil
import zlib
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, peak_rss, run_cli
from safetensors.numpy import load_file, save_file
from tiny_models import logits, make_tiny, random_ids

from upcycler.io import read_checkpoint, write_checkpoint
from upcycler.io.checkpoint import Checkpoint
from upcycler.merge import (
    METHODS,
    MergeInput,
    describe_plan,
    find_checkpoints,
    merge_checkpoints,
    plan_merge,
    weighted_average,
)
from upcycler.tensors import LazyTensor, TensorMap

SEEDS = (1, 2, 3)


def stored(directory: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def canonical(hf: str) -> str:
    """The canonical name of a Llama/Mixtral HF tensor name (for the documented DARE seeding rule)."""
    name = hf.removesuffix(".weight")
    top = {"model.embed_tokens": "embed", "model.norm": "final_norm", "lm_head": "lm_head"}
    if name in top:
        return top[name]
    name = name.removeprefix("model.")
    return name.replace("input_layernorm", "attn_norm").replace("post_attention_layernorm", "mlp_norm") \
        .replace("self_attn.", "attn.")


def merged(tmp_path: Path, paths, method: str, *, base=None, name=None, **kwargs) -> dict[str, np.ndarray]:
    """Merge through the Python API, write as HF, read the files back."""
    ckpt = merge_checkpoints([read_checkpoint(p) for p in paths], method,
                             base=read_checkpoint(base) if base else None, **kwargs)
    out = write_checkpoint(ckpt, tmp_path / (name or f"out-{method}"), progress=False)
    return stored(out)


def assert_matches(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol=1e-5, atol=1e-6) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


# --- references -------------------------------------------------------------------------------------

def ref_average(models, weights) -> dict[str, np.ndarray]:
    return {k: sum(w * m[k].astype(np.float64) for m, w in zip(models, weights)) for k in models[0]}


def ref_slerp(a: np.ndarray, b: np.ndarray, t: float) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cos = np.sum(a64 * b64) / np.sqrt(np.sum(a64 * a64) * np.sum(b64 * b64))
    if abs(cos) > 0.9995:
        return (1 - t) * a64 + t * b64
    theta = np.arccos(cos)
    return (np.sin((1 - t) * theta) * a64 + np.sin(t * theta) * b64) / np.sin(theta)


def ref_trim(delta: np.ndarray, density: float) -> np.ndarray:
    flat = delta.reshape(-1).copy()
    keep = round(density * flat.size)
    order = np.argsort(-np.abs(flat), kind="stable")
    flat[order[keep:]] = 0
    return flat.reshape(delta.shape)


def ref_disjoint(deltas, weights) -> np.ndarray:
    elected = np.sign(sum(w * d for d, w in zip(deltas, weights)))
    num = sum(np.where((np.sign(d) == elected) & (d != 0), w * d, 0.0) for d, w in zip(deltas, weights))
    den = sum(np.where((np.sign(d) == elected) & (d != 0), w, 0.0) for d, w in zip(deltas, weights))
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)


def ref_dare_masks(name: str, shape, n: int, density: float, seed: int, part: int = -1):
    rng = np.random.default_rng([seed, zlib.crc32(canonical(name).encode()), part + 1])
    return [rng.random(shape, dtype=np.float32) < density for _ in range(n)]


def ref_model_stock(xs, base) -> np.ndarray:
    deltas = [x.astype(np.float64) - base for x in xs]
    n = len(deltas)
    cos = np.mean([np.sum(a * b) / np.sqrt(np.sum(a * a) * np.sum(b * b)) for a, b in combinations(deltas, 2)])
    cos = min(max(cos, 0.0), 1.0)
    t = n * cos / (1 + (n - 1) * cos)
    return base + t * sum(deltas) / n


# --- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamas")
    return [make_tiny("llama", root / f"m{s}", seed=s) for s in SEEDS]


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("base") / "base", seed=0)


# --- averaging ----------------------------------------------------------------------------------------

def pma_weights(method: str, n: int, alpha: float = 0.2) -> list[float]:
    if method == "sma":
        w = [1.0] * n
    elif method == "minus-sqrt":  # WSM: differences of the decay 1 − √x at positions 0, 1/n, …, 1
        w = [(1 - (i / n) ** 0.5) - (1 - ((i + 1) / n) ** 0.5) for i in range(n)]
    elif method == "ema":
        w = [alpha * (1 - alpha) ** (n - 1 - i) for i in range(n)]
    else:
        w = [i + 1.0 for i in range(n)]
    return [x / sum(w) for x in w]


@pytest.mark.parametrize("method", ["sma", "ema", "wma", "minus-sqrt"])
def test_pma_averages_match_numpy(tmp_path, llamas, method):
    got = merged(tmp_path, llamas, method)
    assert_matches(got, ref_average([stored(p) for p in llamas], pma_weights(method, len(llamas))))


def test_ema_alpha_and_newest_weighs_most(tmp_path, llamas):
    got = merged(tmp_path, llamas, "ema", options={"alpha": 0.6})
    weights = pma_weights("ema", 3, alpha=0.6)
    assert weights[2] > weights[1] > weights[0]
    assert_matches(got, ref_average([stored(p) for p in llamas], weights))


def test_minus_sqrt_weights_by_hand_and_oldest_weighs_most():
    """WSM weights w_i = √((i+1)/n) − √(i/n), written out by hand for n = 1, 2, 4."""
    weights = METHODS["minus-sqrt"].fn
    assert METHODS["minus-sqrt"].paper == "https://arxiv.org/abs/2507.17634"
    np.testing.assert_allclose(weights(1), [1.0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(weights(2), [0.5 ** 0.5, 1 - 0.5 ** 0.5], rtol=1e-12)
    r2, r3 = 2 ** 0.5, 3 ** 0.5
    np.testing.assert_allclose(weights(4), [0.5, r2 / 2 - 0.5, r3 / 2 - r2 / 2, 1 - r3 / 2], rtol=1e-12)
    np.testing.assert_allclose(weights(4), [0.5, 0.2071067811865476, 0.1589186225978911, 0.1339745962155614],
                               rtol=1e-12)
    for n in (1, 2, 3, 4, 7, 16, 100, 1000):
        w = weights(n)
        assert w.shape == (n,) and (w > 0).all(), n
        assert abs(w.sum() - 1.0) < 1e-12, n
        assert (np.diff(w) < 0).all(), n  # strictly decreasing: the oldest checkpoint weighs most
        assert w[0] == pytest.approx(n ** -0.5, rel=1e-12)  # the oldest weighs 1/√n


def test_linear_matches_numpy_and_no_normalize(tmp_path, llamas):
    models = [stored(p) for p in llamas]
    assert_matches(merged(tmp_path, llamas, "linear", weights=[0.5, 0.3, 0.2]),
                   ref_average(models, [0.5, 0.3, 0.2]))
    scaled = merge_checkpoints([read_checkpoint(p) for p in llamas], "linear", weights=[1.0, 2.0, -0.5],
                               normalize=False)
    out = stored(write_checkpoint(scaled, tmp_path / "scaled", progress=False))
    assert_matches(out, ref_average(models, [1.0, 2.0, -0.5]))


@pytest.mark.parametrize("method", ["sma", "ema", "wma", "minus-sqrt", "linear"])
def test_averaging_identical_checkpoints_is_bit_exact(tmp_path, llamas, method):
    n = 5
    weights = [0.1, 0.3, 0.2, 0.15, 0.25] if method == "linear" else None
    got = merged(tmp_path, [llamas[0]] * n, method, weights=weights)
    want = stored(llamas[0])
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weighted_average_kernel_across_chunks_and_threads(dtype):
    """Large enough for several chunks on every worker; signed zeros survive an average of copies."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1500, 1031), dtype=np.float32).astype(dt) for _ in range(3)]
    got = weighted_average(iter(xs), [0.2, 0.0, 0.8])
    want = 0.2 * xs[0].astype(np.float64) + 0.8 * xs[2].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # inputs ~N(0, 1): fp32 steps of ~1e-7
    np.testing.assert_allclose(weighted_average(iter(xs), [1.0, -2.0, 0.5]),
                               sum(w * x.astype(np.float64) for w, x in zip([1.0, -2.0, 0.5], xs)), rtol=1e-5,
                               atol=1e-5)
    same = xs[0].copy()
    same.reshape(-1)[::7] = -0.0
    out = weighted_average(iter([same] * 4), [0.1, 0.2, 0.3, 0.4], dt)
    assert out.dtype == dt and out.tobytes() == same.tobytes()


def test_output_dtype_follows_input_or_dtype_option(tmp_path):
    bf16 = [make_tiny("llama", tmp_path / f"b{s}", seed=s, dtype="bfloat16") for s in SEEDS[:2]]
    got = merged(tmp_path, bf16, "sma")
    want = ref_average([{k: v.astype(np.float32) for k, v in stored(p).items()} for p in bf16], [0.5, 0.5])
    for name, value in got.items():
        assert str(value.dtype) == "bfloat16", name
        np.testing.assert_allclose(value.astype(np.float32), want[name], rtol=1e-2, atol=1e-3, err_msg=name)
    wide = merge_checkpoints([read_checkpoint(p) for p in bf16], "sma", dtype="fp32")
    out = stored(write_checkpoint(wide, tmp_path / "wide", progress=False))
    for name, value in out.items():  # accumulated in fp32 and never rounded to bf16 on the way
        np.testing.assert_allclose(value, want[name], rtol=1e-6, atol=1e-7, err_msg=name)


# --- two-model and task-vector methods ---------------------------------------------------------------

@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_slerp_matches_numpy(tmp_path, llamas, t):
    a, b = stored(llamas[0]), stored(llamas[1])
    got = merged(tmp_path, llamas[:2], "slerp", options={"t": t})
    assert_matches(got, {k: ref_slerp(a[k], b[k], t) for k in a})
    if t in (0.0, 1.0):
        end = a if t == 0.0 else b
        assert all(got[k].tobytes() == end[k].tobytes() for k in end)


def test_task_arithmetic_matches_numpy(tmp_path, llamas, llama_base):
    base, models = stored(llama_base), [stored(p) for p in llamas]
    w, lam = [1.0, 0.5, -0.25], 0.7
    got = merged(tmp_path, llamas, "task-arithmetic", base=llama_base, weights=w, options={"lambda_": lam})
    want = {k: base[k] + lam * sum(wi * (m[k].astype(np.float64) - base[k]) for m, wi in zip(models, w))
            for k in base}
    assert_matches(got, want)


@pytest.mark.parametrize("density", [0.2, 0.7])
def test_ties_matches_numpy(tmp_path, llamas, llama_base, density):
    base, models = stored(llama_base), [stored(p) for p in llamas]
    w = [1.0, 0.6, 0.3]
    got = merged(tmp_path, llamas, "ties", base=llama_base, weights=w, options={"density": density})
    want = {}
    for k in base:
        deltas = [ref_trim(m[k] - base[k], density).astype(np.float64) for m in models]
        want[k] = base[k] + ref_disjoint(deltas, w)
    assert_matches(got, want)


@pytest.mark.parametrize("method", ["dare-linear", "dare-ties"])
def test_dare_matches_numpy_with_documented_seeding(tmp_path, llamas, llama_base, method):
    base, models = stored(llama_base), [stored(p) for p in llamas]
    density, seed, lam = 0.4, 7, 0.9
    got = merged(tmp_path, llamas, method, base=llama_base, seed=seed, options={"density": density, "lambda_": lam})
    want = {}
    for k in base:
        masks = ref_dare_masks(k, base[k].shape, len(models), density, seed)
        deltas = [(m[k] - base[k]) * mask / np.float64(density) for m, mask in zip(models, masks)]
        merged_delta = sum(deltas) if method == "dare-linear" else ref_disjoint(deltas, [1.0] * len(models))
        want[k] = base[k] + lam * merged_delta
    assert_matches(got, want)


def test_dare_is_deterministic_and_seed_dependent(tmp_path, llamas, llama_base):
    runs = [merged(tmp_path, llamas, "dare-linear", base=llama_base, seed=s, name=f"run{i}")
            for i, s in enumerate((3, 3, 4))]
    name = "model.layers.0.mlp.up_proj.weight"
    assert runs[0][name].tobytes() == runs[1][name].tobytes()
    assert runs[0][name].tobytes() != runs[2][name].tobytes()


def test_model_stock_matches_numpy(tmp_path, llamas, llama_base):
    base, models = stored(llama_base), [stored(p) for p in llamas]
    got = merged(tmp_path, llamas, "model-stock", base=llama_base)
    assert_matches(got, {k: ref_model_stock([m[k] for m in models], base[k].astype(np.float64)) for k in base})


# --- outputs load, lineage ----------------------------------------------------------------------------

def test_merged_output_loads_in_transformers_with_its_lineage(tmp_path, llamas):
    import transformers

    ckpt = merge_checkpoints([MergeInput(read_checkpoint(p), step=1000 * (i + 1)) for i, p in enumerate(llamas)],
                             "ema", options={"alpha": 0.3})
    out = write_checkpoint(ckpt, tmp_path / "ema", progress=False)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert np.isfinite(logits(out, random_ids())).all()
    step = json.loads((out / "upcycler.json").read_text())["lineage"][-1]
    assert step["step"] == "merge" and step["method"] == "ema" and step["options"] == {"alpha": 0.3}
    assert [i["step"] for i in step["inputs"]] == [1000, 2000, 3000]
    assert [i["source"] for i in step["inputs"]] == [str(p) for p in llamas]
    assert all(i["lineage"][0]["step"] == "read" for i in step["inputs"])
    assert step["weights"] == pytest.approx(pma_weights("ema", 3, alpha=0.3))


def test_averaging_identical_keeps_logits(tmp_path, llamas):
    """Three copies of one checkpoint (the same directory named twice is refused: it would count double)."""
    out = tmp_path / "same"
    copies = [shutil.copytree(llamas[1], tmp_path / f"copy{k}") for k in range(2)]
    run_cli("merge", llamas[1], *copies, out, "--method", "sma")
    ids = random_ids()
    np.testing.assert_array_equal(logits(out, ids), logits(llamas[1], ids))


# --- MoE ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixtrals(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtrals")
    return [make_tiny("mixtral", root / f"x{s}", seed=s) for s in (0, *SEEDS)]


def test_moe_merges_expert_by_expert(tmp_path, mixtrals):
    base, inputs = mixtrals[0], mixtrals[1:]
    models, b = [stored(p) for p in inputs], stored(base)
    got = merged(tmp_path, inputs, "wma")
    assert_matches(got, ref_average(models, pma_weights("wma", 3)))
    got = merged(tmp_path, inputs, "ties", base=base, options={"density": 0.5})
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in got
    for k in b:  # every tensor, and so every expert's own w1/w2/w3, is trimmed and elected on its own
        want = b[k] + ref_disjoint([ref_trim(m[k] - b[k], 0.5).astype(np.float64) for m in models], [1.0] * 3)
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
    assert np.isfinite(logits(tmp_path / "out-ties", random_ids())).all()


def test_moe_dare_seeds_each_expert(tmp_path, mixtrals):
    base, inputs = mixtrals[0], mixtrals[1:]
    models, b = [stored(p) for p in inputs], stored(base)
    got = merged(tmp_path, inputs, "dare-linear", base=base, seed=5, options={"density": 0.5})
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    masks = ref_dare_masks("layers.1.moe.experts.up_proj", b[name].shape, 3, 0.5, seed=5, part=2)
    want = b[name] + sum((m[name] - b[name]) * mask / 0.5 for m, mask in zip(models, masks))
    np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)


def test_stacked_experts_are_read_one_expert_at_a_time(mixtrals):
    def parts_only(ckpt: Checkpoint) -> Checkpoint:
        def refuse():
            raise AssertionError("a whole stacked expert tensor was loaded")

        tensors = {k: LazyTensor(t.shape, t.dtype, refuse, t.part) if ".experts." in k else t
                   for k, t in ckpt.tensors.items()}
        return ckpt.replace(tensors=TensorMap(tensors))

    inputs = [parts_only(read_checkpoint(p)) for p in mixtrals[1:]]
    out = merge_checkpoints(inputs, "sma")
    name = "layers.0.moe.experts.down_proj"
    want = np.mean([read_checkpoint(p).tensors[name].part(1) for p in mixtrals[1:]], axis=0)
    np.testing.assert_allclose(out.tensors[name].part(1), want, rtol=1e-5, atol=1e-7)


def test_dry_run_reads_no_tensor(mixtrals):
    def unreadable(ckpt: Checkpoint) -> Checkpoint:
        def refuse(*_):
            raise AssertionError("a tensor was read")

        return ckpt.replace(tensors=TensorMap({k: LazyTensor(t.shape, t.dtype, refuse, refuse)
                                               for k, t in ckpt.tensors.items()}))

    plan = plan_merge([unreadable(read_checkpoint(p)) for p in mixtrals], "ema", options={"alpha": 0.5})
    text = describe_plan(plan)
    assert "0.533333" in text and "mixtral" in text  # newest weight: 0.5 / (1 − 0.5^4)


# --- Orbax and run directories -------------------------------------------------------------------------

def test_sma_over_orbax_checkpoints_is_the_mean_of_the_trees(tmp_path, llamas):
    """Orbax step directories of a run (as the trainer lays them out) in, Orbax out, trees read by Orbax."""
    pytest.importorskip("upcycler.io.orbax_write", reason="needs the Orbax reader/writer (upcycler/io/orbax_write.py)")
    from orbax.checkpoint.experimental import v1 as ocp

    run = tmp_path / "run"
    run.mkdir()
    steps = [write_checkpoint(read_checkpoint(p), run / str(1000 * (i + 1)), to="orbax", progress=False)
             for i, p in enumerate(llamas)]
    out = tmp_path / "merged"
    run_cli("merge", run, out, "--method", "sma", "--to", "orbax")
    trees = [dict(_flatten(ocp.load(d / "params"))) for d in (*steps, out)]
    assert trees[-1].keys() == trees[0].keys()
    for key, value in trees[-1].items():
        want = np.mean([np.asarray(tree[key], dtype=np.float64) for tree in trees[:-1]], axis=0)
        np.testing.assert_allclose(np.asarray(value, dtype=np.float64), want, rtol=1e-6, atol=1e-7, err_msg=key)
    step = next(s for s in read_checkpoint(out).lineage if s["step"] == "merge")
    assert step["method"] == "sma" and [i["step"] for i in step["inputs"]] == [1000, 2000, 3000]


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}/")
    else:
        yield prefix.rstrip("/"), tree


def make_run(root: Path, model: Path, layout: dict[str, str]) -> Path:
    """A run directory: step dir name -> "" (checkpoint in the step dir) or a sub-directory name."""
    for step, sub in layout.items():
        shutil.copytree(model, root / step / sub if sub else root / step)
    return root


def test_run_directory_picks_steps_by_rule(tmp_path, llamas):
    run = make_run(tmp_path / "run", llamas[0], {"500": "", "1000": "params", "step_1500": "", "step_2000": "",
                                                  "3000": "params", "4000.orbax-checkpoint-tmp-7": ""})
    (run / "events.log").write_text("not a step")
    found = find_checkpoints([run], last=3, every=1000)
    assert found == [(run / "1000" / "params", 1000), (run / "step_2000", 2000), (run / "3000" / "params", 3000)]
    assert [s for _, s in find_checkpoints([run], last=2, until=2000)] == [1500, 2000]
    assert [s for _, s in find_checkpoints([run])] == [500, 1000, 1500, 2000, 3000]


def test_cli_merges_last_steps_of_a_run(tmp_path, llamas):
    run = tmp_path / "run"
    for step, model in zip((1000, 2000, 3000), llamas):
        shutil.copytree(model, run / f"step_{step}")
    shutil.copytree(llamas[0], run / "1500")
    dry = run_cli("merge", run, tmp_path / "out", "--method", "wma", "--last", "2", "--every", "1000", "--dry-run")
    rows = [line.split() for line in dry.stdout.splitlines() if line.startswith("  ") and "step_" in line]
    assert [(row[2], Path(row[3]).name) for row in rows] == [("2000", "step_2000"), ("3000", "step_3000")]
    assert not (tmp_path / "out").exists()
    run_cli("merge", run, tmp_path / "out", "--method", "wma", "--last", "2", "--every", "1000")
    want = ref_average([stored(llamas[1]), stored(llamas[2])], [1 / 3, 2 / 3])
    assert_matches(stored(tmp_path / "out"), want)
    step = json.loads((tmp_path / "out" / "upcycler.json").read_text())["lineage"][-1]
    assert [i["step"] for i in step["inputs"]] == [2000, 3000]


def test_cli_minus_sqrt_over_a_run_is_the_wsm_weighted_average(tmp_path, llamas):
    """`--method minus-sqrt` over steps 1000, 2000, 3000 (step 1500 skipped by --every): weights
    √(1/3), √(2/3) − √(1/3), 1 − √(2/3), oldest first."""
    run = tmp_path / "run"
    for step, model in zip((1000, 2000, 3000), llamas):
        shutil.copytree(model, run / f"step_{step}")
    shutil.copytree(llamas[0], run / "1500")
    weights = [(1 / 3) ** 0.5, (2 / 3) ** 0.5 - (1 / 3) ** 0.5, 1 - (2 / 3) ** 0.5]
    dry = run_cli("merge", run, tmp_path / "out", "--method", "minus-sqrt", "--every", "1000", "--dry-run")
    assert "https://arxiv.org/abs/2507.17634" in dry.stdout
    rows = [line.split() for line in dry.stdout.splitlines() if line.startswith("  ") and "step_" in line]
    assert [int(row[2]) for row in rows] == [1000, 2000, 3000]
    np.testing.assert_allclose([float(row[1]) for row in rows], weights, rtol=1e-5)
    run_cli("merge", run, tmp_path / "out", "--method", "minus-sqrt", "--every", "1000")
    assert_matches(stored(tmp_path / "out"), ref_average([stored(p) for p in llamas], weights))
    step = json.loads((tmp_path / "out" / "upcycler.json").read_text())["lineage"][-1]
    assert [i["step"] for i in step["inputs"]] == [1000, 2000, 3000]


# --- memory ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_inputs(tmp_path_factory) -> list[Path]:
    """8 checkpoints whose largest tensor is 16 MiB, so holding one per input would show plainly."""
    root = tmp_path_factory.mktemp("wide")
    first = make_tiny("llama", root / "in0", vocab_size=8192, hidden_size=512, intermediate_size=1024,
                      num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=1)
    tensors = load_file(first / "model.safetensors")
    rng = np.random.default_rng(0)
    paths = [first]
    for i in range(1, 8):
        shutil.copytree(first, root / f"in{i}", ignore=shutil.ignore_patterns("*.safetensors"))
        noisy = {k: v + rng.standard_normal(v.shape, dtype=np.float32) * 0.01 for k, v in tensors.items()}
        save_file(noisy, root / f"in{i}" / "model.safetensors", metadata={"format": "pt"})
        paths.append(root / f"in{i}")
    return paths


@pytest.mark.parametrize(("method", "few"), [("sma", 2), ("task-arithmetic", 3)])
def test_peak_memory_does_not_grow_with_inputs(tmp_path, wide_inputs, method, few):
    """8 inputs take the memory of `few` (task-arithmetic: 3, the first count at which the next input is
    read while one is merged and the one before is still being released, as for every count after)."""
    largest = max(t.nbytes for t in load_file(wide_inputs[0] / "model.safetensors").values())
    assert largest == 16 * 2**20
    extra = ["--base", str(wide_inputs[0])] if method == "task-arithmetic" else []
    peaks = {n: peak_rss("merge", *wide_inputs[:n], tmp_path / f"out{n}", "--method", method, *extra)
             for n in (few, 8)}
    # holding every input's tensor would add 16 MiB per extra input; allow a quarter of one tensor of noise
    assert peaks[8] <= peaks[few] + largest // 4, {n: p / 2**20 for n, p in peaks.items()}


# --- refusals ---------------------------------------------------------------------------------------------

def refused(tmp_path: Path, mentions: str, *args) -> None:
    proc = run_cli("merge", *args, tmp_path / "out", check=False)
    assert_clean_failure(proc, mentions=mentions)
    assert leftovers(tmp_path, "out") == []


def test_refuses_mismatched_architectures(tmp_path, llamas, tiny_dir):
    wider = tiny_dir("llama", intermediate_size=96)
    refused(tmp_path, "intermediate_size", llamas[0], wider, "--method", "sma")
    refused(tmp_path, "family", llamas[0], tiny_dir("qwen2"), "--method", "sma")


def test_refuses_bad_weights(tmp_path, llamas, llama_base):
    refused(tmp_path, "one weight per input", *llamas, "--method", "linear", "--weights", "0.5,0.5")
    refused(tmp_path, "pass --no-normalize", *llamas, "--method", "linear", "--weights", "0.5,0.3,0.3")
    refused(tmp_path, "one weight per input", *llamas, "--method", "ties", "--base", llama_base,
            "--weights", "1,1")
    refused(tmp_path, "needs --weights", *llamas, "--method", "linear")
    refused(tmp_path, "computes its own weights", *llamas, "--method", "ema", "--weights", "0.2,0.3,0.5")


def test_refuses_too_few_inputs_and_missing_base(tmp_path, llamas, llama_base):
    refused(tmp_path, "exactly 2 inputs", llamas[0], "--method", "slerp")
    refused(tmp_path, "at least 2 inputs", llamas[0], "--method", "model-stock", "--base", llama_base)
    for method in ("task-arithmetic", "ties", "dare-linear", "dare-ties", "model-stock"):
        refused(tmp_path, "needs --base", *llamas[:2], "--method", method)


def test_refuses_options_the_method_does_not_take(tmp_path, llamas):
    refused(tmp_path, "takes no --alpha", *llamas, "--method", "sma", "--alpha", "0.5")
    refused(tmp_path, "outside", *llamas, "--method", "ema", "--alpha", "1.5")
    (tmp_path / "empty").mkdir()
    refused(tmp_path, "not a run directory", tmp_path / "empty", "--method", "sma")
