"""`dense-to-moe --experts-from`: an MoE whose experts come from several dense models (Branch-Train-MiX).

Checked against what the command promises, never against its own code: copies of one model give the
bytes of the single-source upcycle; different models give, tensor for tensor, the documented slice of the
documented source (× the documented scale), and `mean` tensors an fp64 numpy mean cast once; the outputs
load in transformers and compute what our JAX model computes; a calibrated router sends each corpus's
tokens (measured by transformers' own router logits, on held-out text) to its source's experts; memory
does not grow with the number of sources; and bad inputs are refused in one line, leaving nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, peak_rss, run_cli, snapshot
from safetensors.numpy import load_file, save_file
from tiny_models import logits, make_tiny, random_ids

from upcycler.cli.demo import demo_assets
from upcycler.io import read_checkpoint
from upcycler.model_card import render_model_card
from upcycler.train.evaluation.layerwise import logits_of

BF16 = np.dtype(ml_dtypes.bfloat16)
ARCH = {"intermediate_size": 128, "num_hidden_layers": 3}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """`zoo(family)`: a bf16 base, 4 copies of it, and 4 different models of its architecture (seeds 1–4)."""
    built: dict[str, dict[str, Path]] = {}

    def build(family: str) -> dict[str, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(f"btx-{family}")
            out = {"base": make_tiny(family, root / "base", dtype="bfloat16", **ARCH)}
            for k in range(4):
                out[f"copy{k}"] = Path(shutil.copytree(out["base"], root / f"copy{k}"))
                out[f"ft{k}"] = make_tiny(family, root / f"ft{k}", seed=k + 1, dtype="bfloat16", **ARCH)
            built[family] = out
        return built[family]

    return build


@pytest.fixture(scope="module")
def models(zoo) -> dict[str, Path]:
    return zoo("llama")


def hf(directory: Path) -> dict[str, np.ndarray]:
    return load_file(directory / "model.safetensors")


def ffn(directory: Path, layer: int, which: str) -> np.ndarray:
    return hf(directory)[f"model.layers.{layer}.mlp.{which}.weight"]


# --- copies of one model: the single-source upcycle, byte for byte -------------------------------------

CASES = {  # (family of the dense models, options)
    "qwen3_moe-G2-dense1": ("qwen3", ["--experts", "8", "--topk", "4", "--granularity", "2", "--dense-layers", "1",
                            "--target", "qwen3_moe"]),
    "qwen2_moe-G4-S2": ("llama", ["--experts", "8", "--topk", "4", "--granularity", "4", "--shared-experts",
                                  "2", "--dense-layers", "1", "--target", "qwen2_moe"]),
}


@pytest.mark.parametrize("case", CASES)
def test_copies_of_one_model_give_the_single_source_bytes(tmp_path, zoo, case):
    family, args = CASES[case]
    models = zoo(family)
    run_cli("dense-to-moe", models["base"], tmp_path / "single", *args)
    sources = [f"c{k}={models[f'copy{k}']}" for k in range(4)]
    run_cli("dense-to-moe", models["base"], tmp_path / "multi", *args, "--experts-from", *sources)
    single, multi = hf(tmp_path / "single"), hf(tmp_path / "multi")
    assert sorted(single) == sorted(multi)
    for name in single:
        assert np.array_equal(bits(single[name]), bits(multi[name])), name
    assert json.loads((tmp_path / "single/config.json").read_text()) == \
        json.loads((tmp_path / "multi/config.json").read_text())
    verdict = run_cli("verify", models["base"], tmp_path / "multi")  # exits non-zero when it fails
    assert "top-1 agreement 100.0%" in verdict.stdout


def test_base_named_as_every_source_is_verified_on_write(tmp_path, models):
    """Sources that are BASE's own files make the step function-preserving: checked before the rename."""
    run_cli("dense-to-moe", models["base"], tmp_path / "out", "--experts", "4", "--topk", "2",
            "--experts-from", f"a={models['base']}", f"b={models['base']}")
    manifest = json.loads((tmp_path / "out/upcycler.json").read_text())
    assert manifest["verification"]["passed"] is True



def test_byte_identical_copies_without_manifests_are_verified_and_a_changed_byte_is_not(tmp_path, models):
    """Four copies of a plain HF model (no `upcycler.json`: nothing recorded their digests) are recognised by
    their content, hashed: the step is verified on write. A copy with one weight byte changed (same size)
    is another model: reported as not function-preserving and left unverified."""
    plain = {}
    for name in ("base", "copy0", "copy1", "copy2", "copy3"):
        plain[name] = Path(shutil.copytree(models[name], tmp_path / f"plain-{name}"))
        (plain[name] / "upcycler.json").unlink(missing_ok=True)
    sources = [f"c{k}={plain[f'copy{k}']}" for k in range(4)]
    proc = run_cli("dense-to-moe", plain["base"], tmp_path / "out", "--experts", "8", "--topk", "4",
                   "--experts-from", *sources)
    assert "NOT function-preserving" not in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "out/upcycler.json").read_text())["verification"]["passed"] is True
    weights = plain["copy2"] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor's data
    weights.write_bytes(bytes(data))
    proc = run_cli("dense-to-moe", plain["base"], tmp_path / "changed", "--experts", "8", "--topk", "4",
                   "--experts-from", *sources)
    assert "NOT function-preserving: the experts come from 4 different models" in proc.stdout + proc.stderr
    assert "verification" not in json.loads((tmp_path / "changed/upcycler.json").read_text())

# --- different models: every tensor from the documented place ------------------------------------------

def test_experts_are_the_documented_slices_of_their_sources(tmp_path, zoo):
    """Qwen3-MoE, G = 2 (R = 2): 4 groups, group g from source g; down_proj × R = 2 (exact in bf16);
    attention, norms and embeddings are the fp64 mean of the sources, cast once; dense layer 0 is ft2's."""
    models = zoo("qwen3")
    fts = [models[f"ft{k}"] for k in range(4)]
    out = tmp_path / "out"
    run_cli("dense-to-moe", models["base"], out, "--experts", "8", "--topk", "4", "--granularity", "2",
            "--dense-layers", "1", "--target", "qwen3_moe", "--shared-params", "mean", "--shared-ffn", "s2",
            "--experts-from", *[f"s{k}={p}" for k, p in enumerate(fts)])
    moe = read_checkpoint(out).tensors
    f = 64  # F / G
    for layer in (1, 2):
        for e in range(8):
            src, member = fts[e // 2], e % 2
            window = slice(member * f, (member + 1) * f)
            for which in ("gate_proj", "up_proj"):
                got = moe[f"layers.{layer}.moe.experts.{which}"].part(e)
                assert np.array_equal(bits(got), bits(ffn(src, layer, which)[window])), (layer, e, which)
            want_down = (ffn(src, layer, "down_proj")[:, window].astype(np.float32) * 2).astype(BF16)
            assert np.array_equal(bits(moe[f"layers.{layer}.moe.experts.down_proj"].part(e)), bits(want_down))
    for which in ("gate_proj", "up_proj", "down_proj"):  # the dense first layer comes from --shared-ffn s2
        assert np.array_equal(bits(moe[f"layers.0.mlp.{which}"].load()), bits(ffn(fts[2], 0, which)))
    written = hf(out)
    inputs = [hf(p) for p in fts]
    shared = [n for n in written if "mlp" not in n]
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_norm.weight", "model.norm.weight",
            "model.layers.2.post_attention_layernorm.weight"} <= set(shared)
    for name in shared:
        mean = np.mean([t[name].astype(np.float64) for t in inputs], axis=0).astype(BF16)
        assert np.array_equal(bits(written[name]), bits(mean)), name
    card = render_model_card(out)
    assert "s0: experts 0–1 from" in card and "s3: experts 6–7 from" in card
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert info["moe"]["expert_sources"] == {f"s{k}": [2 * k, 2 * k + 1] for k in range(4)}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_outputs_load_in_transformers_and_match_the_jax_model(tmp_path, zoo, family):
    """Different sources, shared tensors from BASE (default) and from one source by name."""
    models = zoo("qwen3" if family == "qwen3_moe" else "llama")
    out = tmp_path / family
    shared = ["--shared-params", "s1"] if family == "qwen3_moe" else []
    run_cli("dense-to-moe", models["base"], out, "--experts", "8", "--topk", "2", "--target", family, *shared,
            "--experts-from", *[f"s{k}={models[f'ft{k}']}" for k in range(4)])
    ids = random_ids(2, 24)
    hf_logits = logits(out, ids)
    jax_logits = logits_of(read_checkpoint(out), ids)
    assert np.isfinite(hf_logits).all()
    np.testing.assert_allclose(jax_logits, hf_logits, atol=2e-5 * np.abs(hf_logits).max())
    written, owner = hf(out), hf(models["ft1"] if shared else models["base"])
    for name in ("model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight", "model.norm.weight"):
        assert np.array_equal(bits(written[name]), bits(owner[name])), name


# --- a router that knows the domains --------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_btx(tmp_path_factory) -> dict[str, Path]:
    """Three domain sources made from the demo model (FFNs perturbed apart), and calibration data from the
    demo corpus's training split; held-out text is kept for measuring."""
    root = tmp_path_factory.mktemp("demo-btx")
    assets = demo_assets()
    paths = {"root": root}
    for k, name in enumerate(("code", "prose", "math")):
        d = Path(shutil.copytree(assets / "model", root / name))
        tensors = load_file(d / "model.safetensors")
        rng = np.random.default_rng(k)
        tensors = {n: (t + rng.normal(0, 1e-3, t.shape)).astype(t.dtype) if ".mlp." in n else t
                   for n, t in tensors.items()}
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        paths[name] = d
    corpus = assets / "corpus"
    run_cli("prepare-data", "--tokenizer", assets / "tokenizer.json", "--out", root / "calib",
            *[a for n in ("code", "prose", "math") for a in ("--source", f"{n}={corpus / f'{n}.train.jsonl'}")])
    return paths


def own_share(model_dir: Path, text_ids: dict[str, np.ndarray], experts_per_source: int) -> dict[str, float]:
    """Share of each corpus's routed token copies that transformers' own router sends to that corpus's
    experts (top-k of its router logits), over every MoE layer."""
    import torch
    from tiny_models import load_model

    model = load_model(model_dir)
    k = model.config.num_experts_per_tok
    out = {}
    for s, (name, ids) in enumerate(text_ids.items()):
        with torch.no_grad():
            result = model(torch.as_tensor(ids), output_router_logits=True)
        chosen = torch.cat([torch.topk(r.float(), k, dim=-1).indices.reshape(-1) for r in result.router_logits])
        out[name] = float((chosen // experts_per_source == s).float().mean())
    return out


def heldout_ids(length: int = 128, count: int = 8) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    assets = demo_assets()
    tok = Tokenizer.from_file(str(assets / "tokenizer.json"))
    out = {}
    for name in ("code", "prose", "math"):
        docs = [json.loads(line)["text"] for line in (assets / "corpus" / f"{name}.heldout.jsonl").open()]
        ids = np.concatenate([tok.encode(d).ids for d in docs])
        count_here = min(count, len(ids) // length)
        out[name] = ids[: count_here * length].reshape(count_here, length)
    return out


def test_centroid_router_sends_each_domain_to_its_experts(tmp_path, demo_btx):
    base = demo_assets() / "model"
    sources = [f"{n}={demo_btx[n]}" for n in ("code", "prose", "math")]
    common = ["--experts", "6", "--topk", "2", "--target", "mixtral", "--experts-from", *sources]
    centroid = run_cli("dense-to-moe", base, tmp_path / "centroids", *common, "--router-init", "centroids",
                       "--calibration", demo_btx["root"] / "calib", "--calibration-sequences", "32",
                       "--calibration-length", "128")
    assert "first forward on the calibration data" in centroid.stderr
    run_cli("dense-to-moe", base, tmp_path / "random", *common)
    text = heldout_ids()
    calibrated = own_share(tmp_path / "centroids", text, 2)
    random = own_share(tmp_path / "random", text, 2)
    assert all(v > 0.5 for v in calibrated.values()), calibrated
    assert not all(v > 0.5 for v in random.values()), random
    assert np.mean(list(random.values())) < 0.5 < np.mean(list(calibrated.values()))


# --- memory ---------------------------------------------------------------------------------------------

def test_peak_memory_is_flat_in_the_number_of_sources(tmp_path):
    """One layer whose dense FFN tensors are 16 MiB each: holding one more source's tensor would show."""
    base = make_tiny("llama", tmp_path / "base", vocab_size=256, hidden_size=512, intermediate_size=8192,
                     num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=1)
    tensors = load_file(base / "model.safetensors")
    largest = max(t.nbytes for t in tensors.values())
    assert largest == 16 * 2**20
    rng = np.random.default_rng(0)
    sources = []
    for k in range(8):
        d = Path(shutil.copytree(base, tmp_path / f"s{k}", ignore=shutil.ignore_patterns("*.safetensors")))
        noisy = {n: t + rng.standard_normal(t.shape, dtype=np.float32) * 0.01 for n, t in tensors.items()}
        save_file(noisy, d / "model.safetensors", metadata={"format": "pt"})
        sources.append(f"s{k}={d}")
    peaks = {}
    for n in (2, 4, 8):
        peaks[n] = peak_rss("dense-to-moe", base, tmp_path / f"o{n}", "--experts", "8", "--topk", "2",
                            "--experts-from", *sources[:n])
        shutil.rmtree(tmp_path / f"o{n}")
    # one more source's FFN held at once would add 16 MiB per source; allow a quarter of one tensor of noise
    assert peaks[8] <= peaks[2] + largest // 4, {n: p / 2**20 for n, p in peaks.items()}
    assert peaks[4] <= peaks[2] + largest // 4, {n: p / 2**20 for n, p in peaks.items()}


# --- recipes --------------------------------------------------------------------------------------------

def test_recipe_with_relative_paths_and_an_explicit_assignment(tmp_path, models):
    for k in (0, 1):
        shutil.copytree(models[f"ft{k}"], tmp_path / f"src{k}")
    shutil.copytree(models["base"], tmp_path / "base")
    recipe = {"source": "base", "output": {"path": "out"},
              "transforms": [{"dense-to-moe": {"experts": 4, "topk": 2, "target": "mixtral",
                                               "experts_from": {"a": "src0", "b": "src1"},
                                               "expert_sources": ["b", "b", "a", "a"]}}]}
    (tmp_path / "btx.yaml").write_text(json.dumps(recipe))
    run_cli("run", tmp_path / "btx.yaml")
    moe = read_checkpoint(tmp_path / "out").tensors
    for e, src in enumerate(("src1", "src1", "src0", "src0")):
        assert np.array_equal(bits(moe["layers.0.moe.experts.up_proj"].part(e)), bits(ffn(tmp_path / src, 0, "up_proj")))
    info = json.loads(run_cli("inspect", tmp_path / "out", "--json").stdout)
    assert info["moe"]["expert_sources"] == {"b": [0, 1], "a": [2, 3]}
    recipe["transforms"][0]["dense-to-moe"].update(granularity=2, expert_sources=["a", "b", "a", "a"])
    (tmp_path / "mixed.yaml").write_text(json.dumps({**recipe, "output": {"path": "out2"}}))
    assert_clean_failure(run_cli("run", tmp_path / "mixed.yaml", check=False), mentions="virtual group 0")
    assert leftovers(tmp_path, "out2") == []


# --- refusals -------------------------------------------------------------------------------------------

def test_bad_sources_are_refused_in_one_line(tmp_path, models, tiny_dir):
    base = models["base"]
    wider = tiny_dir("llama", dtype="bfloat16", **{**ARCH, "intermediate_size": 96})
    fp32 = tiny_dir("llama", **ARCH)
    with_tok = Path(shutil.copytree(models["ft0"], tmp_path / "with_tok"))
    shutil.copy(demo_assets() / "tokenizer.json", with_tok / "tokenizer.json")
    good = [f"s{k}={models[f'ft{k}']}" for k in range(2)]
    moe = ["--experts", "4", "--topk", "2"]
    cases = [
        ("intermediate_size", [*moe, "--experts-from", good[0], f"w={wider}"]),
        ("convert the source", [*moe, "--experts-from", good[0], f"f={fp32}"]),
        ("tokenizer", [*moe, "--experts-from", good[0], f"t={with_tok}"]),
        ("no such directory", [*moe, "--experts-from", good[0], f"m={tmp_path / 'missing'}"]),
        ("NAME=VALUE", [*moe, "--experts-from", "justapath"]),
        ("rename it", [*moe, "--experts-from", good[0], f"mean={models['ft1']}"]),
        ("use base, mean or a source name", [*moe, "--experts-from", *good, "--shared-params", "nope"]),
        ("every source needs a group", ["--experts", "2", "--topk", "2", "--experts-from", *good,
                                        f"s2={models['ft2']}"]),
        ("add --experts-from", [*moe, "--shared-params", "mean"]),
        ("needs --calibration", [*moe, "--experts-from", *good, "--router-init", "centroids"]),
        ("two or more", [*moe, "--experts-from", good[0], "--router-init", "centroids",
                         "--calibration", tmp_path / "calibration"]),  # not around OUT: that is refused first
    ]
    for mentions, args in cases:
        proc = run_cli("dense-to-moe", base, tmp_path / "out", *args, check=False)
        assert_clean_failure(proc, mentions=mentions)
        assert leftovers(tmp_path, "out") == [], mentions


def test_output_over_a_source_is_refused_and_the_source_kept(tmp_path, models):
    victim = Path(shutil.copytree(models["ft0"], tmp_path / "victim"))
    before = snapshot(victim)
    proc = run_cli("dense-to-moe", models["base"], victim, "--experts", "4", "--topk", "2", "--overwrite",
                   "--experts-from", f"a={victim}", f"b={models['ft1']}", check=False)
    assert_clean_failure(proc, mentions=str(victim.name))
    assert snapshot(victim) == before
