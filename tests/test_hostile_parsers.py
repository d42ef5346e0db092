"""Untrusted documents: recipes, config.json, the HF index, the Orbax manifest, and the JSON/YAML door.

Property-based (Hypothesis): any generated input gives a valid object or one `UpcyclerError`, never
another exception, within a bounded time. Then the hostile cases of the catalogue through the real CLI:
alias bombs, deep nesting, FIFOs and devices where a file should be, directories, binary files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import string
from pathlib import Path

import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import make_tiny

from upcycler.errors import UpcyclerError
from upcycler.io.hf_read import shard_files
from upcycler.transforms.recipe import recipe_from_dict
from upcycler.untrusted import MAX_NESTING, describe, escape, parse_json, parse_yaml

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)

BOMB = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
)


# --- the JSON / YAML door -------------------------------------------------------------------------

@FUZZ
@given(st.text(alphabet=string.printable + "\u00e9\u2028", max_size=300))
def test_any_text_is_json_or_one_error(text):
    try:
        parse_json(text, "x.json")
    except UpcyclerError as err:
        assert "\n" not in str(err)


@FUZZ
@given(st.text(alphabet="[]{}:,-&*!|>'\"#?% \nabc019.e", max_size=300))
def test_any_text_is_yaml_or_one_error(text):
    try:
        parse_yaml(text, "x.yaml")
    except UpcyclerError as err:
        assert "\n" not in str(err)


@FUZZ
@given(json_values)
def test_valid_json_round_trips_exactly(value):
    text = json.dumps(value)
    if _has_non_finite(value):
        with pytest.raises(UpcyclerError, match="not a JSON number"):
            parse_json(text, "x.json")
    else:
        assert parse_json(text, "x.json") == value


def _has_non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


def test_bombs_and_nesting_are_refused_quickly():
    with pytest.raises(UpcyclerError, match="expands to more than"):
        parse_yaml(BOMB + "\nsteps: *i\n", "train.yaml")
    with pytest.raises(UpcyclerError, match="nested"):
        parse_yaml("[" * 100_000, "r.yaml")
    with pytest.raises(UpcyclerError, match="nested"):
        parse_json("[" * 100_000 + "]" * 100_000, "c.json")
    with pytest.raises(UpcyclerError, match="nested"):
        parse_json("[" * (MAX_NESTING + 2) + "]" * (MAX_NESTING + 2), "c.json")
    with pytest.raises(UpcyclerError, match="unreadable JSON"):
        parse_json("1" * 5000, "c.json")
    assert parse_yaml("a: &x {k: 1}\nb: *x\n", "ok.yaml") == {"a": {"k": 1}, "b": {"k": 1}}  # aliases still work


@FUZZ
@given(json_values | st.integers(min_value=10**300, max_value=10**400))
def test_describe_is_short_and_one_line(value):
    text = describe(value)
    assert len(text) <= 60 and "\n" not in text


def test_escape_keeps_messages_on_one_line():
    assert escape("a\nb\rc\x1b[31m") == "a\\nb\\rc\\x1b[31m"


# --- recipes ---------------------------------------------------------------------------------------

@FUZZ
@given(st.dictionaries(st.sampled_from(["source", "transforms", "output", "other"]), json_values, max_size=4)
       | json_values)
def test_any_recipe_document_is_a_recipe_or_one_error(data):
    try:
        recipe_from_dict(data, Path("."), "r.yaml")
    except UpcyclerError as err:
        assert "\n" not in str(err)


@FUZZ
@given(st.sampled_from(["depth", "dense-to-moe"]),
       st.dictionaries(st.sampled_from(["layers", "method", "experts", "topk", "granularity", "router_std",
                                        "seed", "shared_experts", "dense_layers", "layer_map", "target"]),
                       json_values, max_size=4),
       st.dictionaries(st.sampled_from(["path", "format", "family", "dtype", "shard_size"]), json_values,
                       max_size=5))
def test_recipe_options_and_outputs_are_checked(name, options, output):
    data = {"source": "src", "transforms": [{name: options}], "output": {"path": "out", **output}}
    try:
        recipe_from_dict(data, Path("."), "r.yaml")
    except UpcyclerError as err:
        assert "\n" not in str(err)


# --- the HF index ----------------------------------------------------------------------------------

@FUZZ
@given(json_values)
def test_any_index_gives_shards_or_one_error(tmp_path, weight_map):
    root = tmp_path / "idx"
    root.mkdir(exist_ok=True)
    (root / "model-1.safetensors").write_bytes(b"")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    try:
        for shard in shard_files(root):
            assert shard.parent == root
    except UpcyclerError as err:
        assert "\n" not in str(err)


# --- the Orbax manifest ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax-manifest")
    make_tiny("llama", root / "hf")
    run_cli("convert", root / "hf", root / "orbax", "--to", "orbax")
    return root / "orbax"


@FUZZ
@given(key=st.sampled_from(["format", "spec", "lineage", "files", "tensors"]), value=json_values)
def test_any_manifest_field_gives_a_checkpoint_or_one_error(orbax_dir, tmp_path, key, value):
    from upcycler.io.orbax_read import read_orbax

    manifest = json.loads((orbax_dir / "upcycler.json").read_text())
    manifest[key] = value
    copy = tmp_path / "m"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(orbax_dir, copy, symlinks=True)
    (copy / "upcycler.json").write_text(json.dumps(manifest))
    try:
        ckpt = read_orbax(copy)
        ckpt.tensors["final_norm"].load()
        ckpt.check_inputs()
    except UpcyclerError as err:
        assert "\n" not in str(err)


@FUZZ
@given(field=st.sampled_from(["num_layers", "hidden_size", "num_heads", "vocab_size", "intermediate_size",
                              "head_dim", "num_kv_heads", "rms_norm_eps", "family", "moe", "rope_scaling"]),
       value=json_values)
def test_any_manifest_spec_field_gives_a_checkpoint_or_one_error(orbax_dir, tmp_path, field, value):
    from upcycler.io.orbax_read import read_orbax

    manifest = json.loads((orbax_dir / "upcycler.json").read_text())
    manifest["spec"][field] = value
    copy = tmp_path / "s"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(orbax_dir, copy, symlinks=True)
    (copy / "upcycler.json").write_text(json.dumps(manifest))
    try:
        read_orbax(copy)
    except UpcyclerError as err:
        assert "\n" not in str(err)


# --- through the CLI -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("parsers") / "src")


@pytest.fixture
def src(model, tmp_path):
    return Path(shutil.copytree(model, tmp_path / "src"))


def run_fails(tmp_path, src, *args, mentions, timeout=60):
    before = snapshot(src)
    proc = run_cli(*args, check=False, timeout=timeout)
    line = assert_clean_failure(proc, mentions=mentions)
    assert snapshot(src) == before, "input was modified"
    assert leftovers(tmp_path, "out") == []
    return line


@pytest.mark.parametrize("body,mentions", [
    (BOMB + "\nsource: src\ntransforms:\n  - depth: {layers: *i}\noutput: {path: out}\n", "expands to more than"),
    (BOMB + "\nsource: src\ntransforms:\n  - depth: {layers: 4}\noutput: {path: out, shard_size: *i}\n",
     "expands to more than"),
    ("[" * 100_000, "nested"),
    ("source: src\ntransforms:\n  - depth: {layers: 4}\noutput: {path: out, shard_size: " + "9" * 5000 + "}\n",
     "recipe"),
    ("source: src\ntransforms:\n  - depth: {layers: 4}\noutput: {path: out, shard_size: -5}\n", "shard"),
    ("source: src\ntransforms:\n  - dense-to-moe: {experts: 4, topk: 2, router_std: .nan}\noutput: {path: out}\n",
     "router-std"),
    ("source: src\ntransforms:\n  - {[1, 2]: {layers: 4}}\noutput: {path: out}\n", "recipe.yaml"),
    ("source: src\ntransforms: [depth]\noutput: {path: out}\n", "transforms[0]"),
    ("source: [src]\ntransforms:\n  - depth: {layers: 4}\noutput: {path: out}\n", "source"),
])
def test_hostile_recipes(tmp_path, src, body, mentions):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(body)
    run_fails(tmp_path, src, "run", recipe, mentions=mentions)


def test_a_directory_a_fifo_a_device_and_a_binary_file_as_the_recipe(tmp_path, src):
    run_fails(tmp_path, src, "run", src, mentions="is a directory")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    run_fails(tmp_path, src, "run", fifo, mentions="not a regular file", timeout=30)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    run_fails(tmp_path, src, "run", zero, mentions="not a regular file", timeout=30)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 8)
    run_fails(tmp_path, src, "run", binary, mentions="binary.yaml")
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (2 * 1024**2))
    run_fails(tmp_path, src, "run", huge, mentions="too large")


def test_config_json_that_is_a_fifo_or_dev_zero_is_refused_without_hanging(tmp_path, src):
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    proc = run_cli("inspect", src, check=False, timeout=30)
    assert_clean_failure(proc, mentions="not a regular file")
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("/dev/zero")
    proc = run_cli("convert", src, tmp_path / "out", check=False, timeout=30)
    assert_clean_failure(proc, mentions="not a regular file")
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("config_edit,mentions", [
    (lambda c: {**c, "num_hidden_layers": json.loads("[" * 70 + "]" * 70)}, "nested"),
    (lambda c: "[" * 100_000, "nested"),
    (lambda c: {**c, "hidden_size": float("inf")}, "config.json"),
])
def test_hostile_config_json(tmp_path, src, config_edit, mentions):
    config = json.loads((src / "config.json").read_text())
    edited = config_edit(config)
    (src / "config.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    run_fails(tmp_path, src, "convert", src, tmp_path / "out", mentions=mentions)


def test_a_path_with_a_newline_is_reported_on_one_line(tmp_path, src):
    odd = tmp_path / "line\nbreak"
    line = run_fails(tmp_path, src, "convert", odd, tmp_path / "out", mentions="line\\nbreak")
    assert "\n" not in line


def test_an_index_naming_a_non_string_shard_is_refused(tmp_path, src):
    index = src / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"embed": [["x"] * 1000]}}))
    run_fails(tmp_path, src, "convert", src, tmp_path / "out", mentions="model.safetensors.index.json")


def test_a_small_file_read_under_a_large_cap_costs_its_own_size(tmp_path):
    """`read_bytes` sizes its buffer by the file: a 1 KB config read under the 64 MB JSON cap allocates
    about 1 KB, and a file over the cap is still refused."""
    import tracemalloc

    from upcycler.untrusted import MAX_JSON_BYTES, read_bytes

    small = tmp_path / "small.json"
    small.write_bytes(b"{}" * 512)
    tracemalloc.start()
    try:
        assert read_bytes(small, max_bytes=MAX_JSON_BYTES) == b"{}" * 512
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024**2, f"{peak:,} bytes allocated to read 1 KB"
    with pytest.raises(UpcyclerError, match="larger than 1,000 bytes"):
        read_bytes(small, max_bytes=1000)
