"""Recipes: depth then dense-to-moe in one pass, lineage, dry runs on config-only sources, bad recipes."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from cli_helpers import assert_clean_failure, leftovers, run_cli
from transform_helpers import TOLERANCE, active_by_hand, config, hf_param_count, max_logit_diff, stored

from upcycler.transforms.pipeline import execute, plan
from upcycler.transforms.recipe import load_recipe

CHAIN = [
    {"depth": {"layers": 6, "method": "identity"}},
    {"dense-to-moe": {"experts": 12, "topk": 6, "granularity": 4, "shared-experts": 1, "dense_layers": 1}},
]


def write_recipe(path, source, transforms=CHAIN, **output) -> str:
    path.write_text(yaml.safe_dump({"source": str(source), "transforms": transforms,
                                    "output": {"path": "out", **output}}))
    return str(path)


def test_depth_then_dense_to_moe_in_one_pass(tiny_dir, tmp_path):
    src = tiny_dir("llama", num_hidden_layers=4)
    recipe = write_recipe(tmp_path / "recipe.yaml", src)
    proc = run_cli("run", recipe)
    assert "function preserved" in proc.stdout
    out = tmp_path / "out"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]  # no intermediate checkpoint
    cfg = config(out)
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["mlp_only_layers"]) == ("qwen2_moe", 6, [0])
    assert max_logit_diff(src, out) <= TOLERANCE
    lineage = json.loads((out / "upcycler.json").read_text())["lineage"]
    assert [s["step"] for s in lineage] == ["read", "depth", "dense-to-moe", "recipe"]
    assert lineage[0]["source"] == str(src) and lineage[0]["files"] == {"model.safetensors":
                                                                       (src / "model.safetensors").stat().st_size}
    assert lineage[-1]["recipe"]["transforms"][1]["dense-to-moe"]["shared_experts"] == 1
    assert all(s.get("function_preserving", True) for s in lineage)


def test_recipe_paths_are_relative_to_the_recipe_and_dtype_applies(tiny_dir, tmp_path):
    src = tmp_path / "models" / "dense"
    shutil.copytree(tiny_dir("llama"), src)
    recipe = tmp_path / "recipes" / "grow.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump({"source": "../models/dense", "transforms": [{"depth": {"layers": 3}}],
                                      "output": {"path": "../grown", "dtype": "bf16"}}))
    p = plan(load_recipe(recipe))
    execute(p, progress=False)
    assert config(tmp_path / "grown")["torch_dtype"] == "bfloat16"
    assert {str(a.dtype) for a in stored(tmp_path / "grown").values()} == {"bfloat16"}


def test_dry_run_on_a_config_only_source(tiny_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_dir("llama", num_hidden_layers=4) / "config.json", config_only)
    recipe = write_recipe(tmp_path / "recipe.yaml", config_only)
    info = json.loads(run_cli("run", recipe, "--dry-run", "--json").stdout)
    assert info["config_only_source"] and info["function_preserving"]
    total = hf_param_count(info["config"], tmp_path / "built")
    assert info["total_params"] == total and info["active_params"] == active_by_hand(info["config"], total)
    human = run_cli("run", recipe, "--dry-run").stdout
    assert "depth" in human and "dense-to-moe" in human and f"{total:,} total" in human and "output bytes" in human
    assert leftovers(tmp_path, "out") == []


def test_a_config_only_source_cannot_be_written(tiny_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_dir("llama") / "config.json", config_only)
    proc = run_cli("depth", config_only, tmp_path / "out", "--layers", "3", check=False)
    assert_clean_failure(proc, mentions="only --dry-run")
    assert leftovers(tmp_path, "out") == []


BAD = {
    "unknown-transform": ({"transforms": [{"widen": {}}]}, "unknown transform 'widen'"),
    "unknown-option": ({"transforms": [{"depth": {"layers": 6, "colour": "red"}}]}, "unknown option 'colour'"),
    "wrong-type": ({"transforms": [{"depth": {"layers": "six"}}]}, "layers must be int"),
    "missing-option": ({"transforms": [{"dense-to-moe": {"experts": 8}}]}, "needs --topk"),
    "no-transforms": ({"transforms": []}, "non-empty list"),
    "bad-output": ({"output": {"path": "out", "format": "gguf"}}, "format 'gguf'"),
    "refused-step": ({"transforms": [{"depth": {"layers": 6}}, {"dense-to-moe": {"experts": 8, "topk": 3,
                                                                                  "granularity": 2}}]},
                     "multiple of the routed group"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_recipes(case, tiny_dir, tmp_path):
    changes, mentions = BAD[case]
    data = {"source": str(tiny_dir("llama", num_hidden_layers=4)), "transforms": CHAIN, "output": {"path": "out"},
            **changes}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data))
    assert_clean_failure(run_cli("run", tmp_path / "recipe.yaml", check=False), mentions=mentions)
    assert leftovers(tmp_path, "out") == []


def test_unreadable_recipe_file(tmp_path):
    (tmp_path / "recipe.yaml").write_text("source: [unclosed\n")
    assert_clean_failure(run_cli("run", tmp_path / "recipe.yaml", check=False), mentions="not valid YAML")
    assert_clean_failure(run_cli("run", tmp_path / "missing.yaml", check=False), mentions="no such recipe")
