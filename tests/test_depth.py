"""depth: identity blocks preserve the function (dense and MoE), SOLAR's layer map, per-layer lists, refusals."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli
from transform_helpers import TOLERANCE, config, hf_param_count, max_logit_diff, run_transform, stored

from upcycler.transforms.depth import format_layer_map, parse_layer_map, solar_map, spread_map


def by_layer(tensors: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    for name, array in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = array
    return out


@pytest.mark.parametrize("layers", [6, 8])
def test_identity_blocks_preserve_the_function(layers, tiny_dir, tmp_path):
    src = tiny_dir("llama", num_hidden_layers=4)
    p = run_transform("depth", src, tmp_path / "out", layers=layers)
    assert p.exact and config(tmp_path / "out")["num_hidden_layers"] == layers
    assert max_logit_diff(src, tmp_path / "out") <= TOLERANCE


def test_identity_copies_zero_only_the_residual_writers(tiny_dir, tmp_path):
    src = tiny_dir("llama", num_hidden_layers=4)
    run_transform("depth", src, tmp_path / "out", layers=6)
    a, b = by_layer(stored(src)), by_layer(stored(tmp_path / "out"))
    assert spread_map(4, 6) == [0, 1, 1, 2, 3, 3]
    for j, s in enumerate([0, 1, 1, 2, 3, 3]):
        copy = j in (2, 5)
        for name, array in a[s].items():
            zeroed = copy and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            assert np.array_equal(b[j][name], np.zeros_like(array) if zeroed else array), (j, name)


@pytest.mark.parametrize("family,layers,dense_key,dense_value", [
    ("qwen2_moe", 6, "mlp_only_layers", [0, 1]),
    ("glm4_moe", 5, "first_k_dense_replace", 1),
])
def test_identity_on_moe_sources(family, layers, dense_key, dense_value, tiny_dir, tmp_path):
    src = tiny_dir(family, num_hidden_layers=3)
    p = run_transform("depth", src, tmp_path / "out", layers=layers)
    cfg = config(tmp_path / "out")
    assert p.exact and cfg["num_hidden_layers"] == layers and cfg[dense_key] == dense_value
    out = by_layer(stored(tmp_path / "out"))
    copy = spread_map(3, layers).index(2) + 1  # the copy of layer 2, an MoE layer
    downs = [k for k in out[copy] if "down_proj" in k]
    assert any("experts.3." in k for k in downs) and any("shared" in k for k in downs)
    assert all(not out[copy][k].any() for k in downs)
    assert max_logit_diff(src, tmp_path / "out") <= TOLERANCE


def test_solar_32_to_48_is_layers_0_23_then_8_31(tiny_dir, tmp_path):
    src = tiny_dir("llama", num_hidden_layers=32, hidden_size=32, intermediate_size=64)
    p = run_transform("depth", src, tmp_path / "out", layers=48, method="solar")
    expected = list(range(24)) + list(range(8, 32))
    assert solar_map(32, 48) == expected
    assert not p.exact and any("NOT function-preserving" in n.text for n in p.steps[0].notes)
    a, b = by_layer(stored(src)), by_layer(stored(tmp_path / "out"))
    assert sorted(b) == list(range(48))
    for j, s in enumerate(expected):
        assert b[j].keys() == a[s].keys()
        for name in a[s]:
            assert b[j][name].tobytes() == a[s][name].tobytes(), (j, name)
    others = stored(tmp_path / "out")
    assert np.array_equal(others["model.embed_tokens.weight"], stored(src)["model.embed_tokens.weight"])


def test_interleave_and_explicit_maps(tiny_dir, tmp_path):
    src = tiny_dir("llama", num_hidden_layers=4)
    p = run_transform("depth", src, tmp_path / "inter", layers=6, method="interleave")
    assert not p.exact and "layer map 0-1,1-3,3" in p.steps[0].notes[0].text  # 0,1,1,2,3,3
    # identity zeroes every repeated layer: 0..3 then zero blocks of 1..3 still computes the source
    p = run_transform("depth", src, tmp_path / "map", layer_map="0-3,1-3")
    assert p.exact and config(tmp_path / "map")["num_hidden_layers"] == 7
    assert max_logit_diff(src, tmp_path / "map") <= TOLERANCE


def test_layer_map_syntax():
    assert parse_layer_map("0-23,8-31", 32) == list(range(24)) + list(range(8, 32))
    assert parse_layer_map("0, 2-3, 1", 4) == [0, 2, 3, 1]
    assert format_layer_map(list(range(24)) + list(range(8, 32))) == "0-23,8-31"


def test_sliding_window_layer_types_follow_their_layers(tiny_dir, tmp_path):
    src = tiny_dir("qwen2", num_hidden_layers=4, use_sliding_window=True, max_window_layers=2, sliding_window=8)
    types = config(src)["layer_types"]
    assert types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    run_transform("depth", src, tmp_path / "out", layers=6)
    assert config(tmp_path / "out")["layer_types"] == [types[s] for s in spread_map(4, 6)]
    assert max_logit_diff(src, tmp_path / "out") <= TOLERANCE


def test_dry_run_counts_match_transformers(tiny_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_dir("qwen2_moe", num_hidden_layers=3) / "config.json", config_only)
    p = run_transform("depth", config_only, None, dry_run=True, layers=8).to_json()
    assert p["config"]["num_hidden_layers"] == 8
    assert p["total_params"] == hf_param_count(p["config"], tmp_path / "built")


REFUSALS = {
    "below-source": (["--layers", "3"], "below the source's 4 layers"),
    "solar-odd": (["--layers", "7", "--method", "solar"], "even --layers"),
    "map-range": (["--layer-map", "0-3,2-9"], "not within layers 0..3"),
    "map-length": (["--layer-map", "0-3,3", "--layers", "6"], "--layer-map has 5 layers"),
    "no-layers": ([], "needs --layers"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals(case, tiny_dir, tmp_path):
    args, mentions = REFUSALS[case]
    proc = run_cli("depth", tiny_dir("llama", num_hidden_layers=4), tmp_path / "out", *args, check=False)
    assert_clean_failure(proc, mentions=mentions)
    assert leftovers(tmp_path, "out") == []
