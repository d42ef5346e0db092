"""`dense-to-moe --allow-approximate`: a target that changes the attention is fitted, measured and refused when poor.

The bundled demo model (a Llama: no q/k norms) upcycled to Qwen3-MoE, which always has them. Checked with
transformers, not with the code that fitted them: on held-out demo text the written model agrees with its
parent far more often than the same model with weight-1 norms (the unfitted change), and the numbers the
write recorded are those transformers measures; without calibration data, or below --min-agreement, the
write is refused in one line and nothing is left behind.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, prepare_demo_corpus, run_cli
from test_experts_from import heldout_ids

from upcycler.cli.demo import demo_assets

MOE = ["--experts", "4", "--topk", "2", "--target", "qwen3_moe", "--allow-approximate"]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """The demo corpus prepared with the demo tokenizer, each source with its held-out split."""
    return prepare_demo_corpus(demo_assets() / "tokenizer.json", tmp_path_factory.mktemp("calibration") / "data")


@pytest.fixture(scope="module")
def written(tmp_path_factory, calibration):
    out = tmp_path_factory.mktemp("approximate") / "qwen3-moe"
    proc = run_cli("dense-to-moe", demo_assets() / "model", out, *MOE, "--calibration", calibration,
                   "--calibration-sequences", "12", "--calibration-length", "128")
    return out, proc


def agreement(parent, model, ids: np.ndarray) -> tuple[float, float]:
    """(mean KL(parent ‖ model) per token, top-1 agreement) by transformers."""
    import torch

    with torch.no_grad():
        want = torch.log_softmax(parent(torch.as_tensor(ids)).logits.double(), -1)
        got = torch.log_softmax(model(torch.as_tensor(ids)).logits.double(), -1)
    kl = float((want.exp() * (want - got)).sum(-1).mean())
    return kl, float((want.argmax(-1) == got.argmax(-1)).double().mean())


def test_fitted_norms_keep_the_model_close_to_its_parent(written, record_property):
    import torch
    from tiny_models import load_model

    out, proc = written
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    recorded = next(step["approximate_attention"] for step in json.loads((out / "upcycler.json").read_text())
                    ["lineage"] if "approximate_attention" in step)
    assert "approximate attention: top-1 agreement" in proc.stderr
    parent, model = load_model(demo_assets() / "model"), load_model(out)
    ids = np.concatenate(list(heldout_ids(length=128, count=4).values()))
    kl, top1 = agreement(parent, model, ids)
    for layer in model.model.layers:  # the same model with the unfitted change: weight-1 norms
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            torch.nn.init.ones_(norm.weight)
    unit_kl, unit_top1 = agreement(parent, model, ids)
    record_property("transformers", {"fitted": [kl, top1], "unit": [unit_kl, unit_top1]})
    record_property("recorded", recorded)
    assert top1 >= unit_top1 + 0.08 and kl <= unit_kl / 2, (kl, top1, unit_kl, unit_top1)  # measured +0.12, 2.7×
    assert abs(recorded["top1"] - top1) < 0.05 and abs(recorded["kl"] - kl) < 0.5 * kl + 0.01, (recorded, kl, top1)
    assert abs(recorded["unfitted_top1"] - unit_top1) < 0.05, (recorded, unit_top1)


def test_without_calibration_or_below_the_floor_nothing_is_written(tmp_path, calibration, written):
    parent = demo_assets() / "model"
    proc = run_cli("dense-to-moe", parent, tmp_path / "blind", *MOE, check=False)
    assert_clean_failure(proc, mentions="--calibration DIR")
    assert not (tmp_path / "blind").exists() and not leftovers(tmp_path, "blind")
    floor = json.loads((written[0] / "upcycler.json").read_text())
    top1 = next(s["approximate_attention"]["top1"] for s in floor["lineage"] if "approximate_attention" in s)
    proc = run_cli("dense-to-moe", parent, tmp_path / "poor", *MOE, "--calibration", calibration,
                   "--calibration-sequences", "12", "--calibration-length", "128",
                   "--min-agreement", f"{min(1.0, top1 + 0.01):.3f}", check=False)
    message = assert_clean_failure(proc, mentions="--min-agreement")
    assert "top-1 agreement with the source" in message
    assert not (tmp_path / "poor").exists() and not leftovers(tmp_path, "poor")


def test_after_an_earlier_recipe_step_and_in_a_dry_run(tmp_path, calibration):
    """depth then dense-to-moe in one recipe: the fit sees the grown model (and its tokenizer files); --dry-run
    checks the calibration data without fitting, and refuses data of another tokenizer in one line."""
    import yaml

    recipe = tmp_path / "recipe.yaml"
    steps = [{"depth": {"layers": 5, "method": "identity"}},
             {"dense-to-moe": {"experts": 4, "topk": 2, "target": "qwen3_moe", "allow_approximate": True,
                               "calibration": str(calibration), "calibration_sequences": 6,
                               "calibration_length": 64}}]
    recipe.write_text(yaml.safe_dump({"source": str(demo_assets() / "model"), "transforms": steps,
                                      "output": {"path": str(tmp_path / "out")}}))
    planned = run_cli("run", recipe, "--dry-run")
    assert "when written" in planned.stderr + planned.stdout and not (tmp_path / "out").exists()
    run_cli("run", recipe)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"]) == (["Qwen3MoeForCausalLM"], 5)
    lineage = json.loads((tmp_path / "out" / "upcycler.json").read_text())["lineage"]
    assert any("approximate_attention" in step for step in lineage)
    other = tmp_path / "other-tokenizer"
    tokenizer = json.loads((demo_assets() / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [*tokenizer.get("added_tokens", []), {
        "id": max(tokenizer["model"]["vocab"].values()) + 1, "content": "<extra>", "single_word": False,
        "lstrip": False, "rstrip": False, "normalized": False, "special": True}]
    (tmp_path / "tok.json").write_text(json.dumps(tokenizer))
    prepare_demo_corpus(tmp_path / "tok.json", other)
    steps[1]["dense-to-moe"]["calibration"] = str(other)
    recipe.write_text(yaml.safe_dump({"source": str(demo_assets() / "model"), "transforms": steps,
                                      "output": {"path": str(tmp_path / "again")}}))
    assert_clean_failure(run_cli("run", recipe, "--dry-run", check=False), mentions="another tokenizer")


@pytest.mark.parametrize(("rotary", "window"), [(1.0, 0), (0.5, 0), (1.0, 5)])
def test_the_fit_attends_as_the_layer_does(rotary, window):
    """The fit's attention as a function of the norm weights (heads first, rotations done once) is the
    layer's (`attention_of` after the norms), with partial rotary dims and a sliding window."""
    import jax.numpy as jnp

    from upcycler.spec import ModelSpec
    from upcycler.train.evaluation import attention_fit as fit

    spec = ModelSpec(family="glm4_moe" if rotary != 1.0 else "qwen3", vocab_size=64, hidden_size=48,
                     num_layers=1, num_heads=6, num_kv_heads=2, head_dim=16, intermediate_size=64,
                     max_position_embeddings=64, qk_norm=True, partial_rotary_factor=rotary)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 12, heads, 16)), jnp.float32) for heads in (6, 2, 2))
    w = jnp.asarray(rng.uniform(0.5, 2.0, (2, 16)), jnp.float32)
    want = fit.heads_first(fit._attention(q, k, v, w, spec, window), 3)
    got = fit._NormedAttention.of(q, k, v, spec, window)(w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(fit._NormedAttention.of(q, k, v, spec, window)(2 * w) - want).max()) > 1e-2  # w matters
