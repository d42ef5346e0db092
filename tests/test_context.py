"""context: RoPE surgery writes only the config, in the form transformers loads, that the JAX model reads alike.

For each method (a larger base, linear interpolation, YaRN, Llama 3's scaling) on a tiny Llama trained for
256 positions, extended to 1,024: the written config loads in transformers (AutoConfig and the model) with
the fields asked for; every tensor's bytes are the source's; the JAX model's logits on 512 positions equal
transformers' on the new config (and differ from the source's there, so the scaling is exercised); the
lineage step records the options and the RoPE before; the command prints KL and top-1 agreement against the
source within the original 256 positions. Then Orbax inputs and outputs, refusals (one line, non-zero exit,
nothing written), `--dry-run` and a longer N alone (function-preserving, verified).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli
from tiny_models import load_model, logits, make_tiny, random_ids

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint

TOL = 1e-4
ORIGINAL, EXTENDED, PROBE = 256, 1024, 512  # the tiny model's max_position_embeddings, the new one, positions run
METHODS = {  # name: (arguments, the rope_parameters transformers must load)
    "theta": (["--rope-theta", "1e6"], {"rope_type": "default", "rope_theta": 1e6}),
    "linear": (["--rope-scaling", "linear", "--factor", "4"], {"rope_type": "linear", "factor": 4.0}),
    "yarn": (["--rope-scaling", "yarn"], {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "original_max_position_embeddings": ORIGINAL}),
    "llama3": (["--rope-scaling", "llama3", "--rope-theta", "5e5"],
               {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL, "rope_theta": 5e5}),
    "yarn-qwen3": (["--rope-scaling", "yarn", "--factor", "8", "--beta-fast", "16"],
                   {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 1.0}),
}
KL_LINE = "within the original 256 positions, against the source on 1 × 256 probe tokens: KL "


@pytest.fixture(scope="module")
def written(tiny_dir, tmp_path_factory):
    """{method: (source, output, the command's stderr)}, each written once by the CLI."""
    out = {}
    root = tmp_path_factory.mktemp("context")
    for name, (args, _) in METHODS.items():
        src = tiny_dir("qwen3" if name.endswith("qwen3") else "llama")
        proc = run_cli("context", src, root / name, "--max-position", EXTENDED, *args)
        out[name] = (src, root / name, proc.stderr)
    return out


def tensor_bytes(directory) -> dict[str, tuple[str, tuple, bytes]]:
    """{name: (dtype, shape, bytes)} of every tensor a checkpoint directory stores (HF or Orbax)."""
    ckpt = read_checkpoint(directory)
    return {name: (str(t.dtype), tuple(t.shape), t.load().tobytes()) for name, t in ckpt.tensors.items()}


def ours(directory, ids: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    from upcycler.train.model import ModelConfig, forward_jit
    from upcycler.train.model import params as P

    ckpt = read_checkpoint(directory)
    out, _ = forward_jit(P.from_tensors(ckpt.spec, ckpt.tensors), jnp.asarray(ids), ckpt.spec, ModelConfig())
    return np.asarray(out)


@pytest.mark.parametrize("method", METHODS)
def test_config_loads_in_transformers_with_the_fields_asked(method, written):
    from transformers import AutoConfig

    _, out, _ = written[method]
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.max_position_embeddings == EXTENDED
    for key, value in METHODS[method][1].items():
        assert cfg.rope_parameters[key] == value, (key, cfg.rope_parameters)
    load_model(out)  # the model builds its rotary embedding from it


@pytest.mark.parametrize("method", METHODS)
def test_every_tensor_is_the_sources_bytes(method, written):
    src, out, _ = written[method]
    assert tensor_bytes(out) == tensor_bytes(src)


@pytest.mark.parametrize("method", METHODS)
def test_jax_model_reads_the_new_rope_as_transformers_does(method, written):
    src, out, _ = written[method]
    ids = random_ids(1, PROBE, seed=3)
    reference = logits(out, ids)
    assert np.abs(ours(out, ids) - reference).max() <= TOL
    assert np.abs(reference - logits(src, ids)).max() > 100 * TOL  # the new RoPE is what ran


@pytest.mark.parametrize("method", METHODS)
def test_lineage_and_the_printed_shift(method, written):
    src, out, stderr = written[method]
    manifest = json.loads((out / "upcycler.json").read_text())
    step = next(s for s in manifest["lineage"] if s.get("step") == "context")
    assert step["function_preserving"] is False and step["config"]["max_position"] == EXTENDED
    assert step["rope_before"] == {"rope_theta": read_checkpoint(src).spec.rope_theta, "rope_scaling": None,
                                   "max_position_embeddings": ORIGINAL}
    assert "verification" not in manifest
    line = next(line for line in stderr.splitlines() if line.startswith("RoPE changed"))
    assert KL_LINE in line and "top-1 agreement" in line, stderr
    kl = float(line.split(KL_LINE)[1].split()[0])
    assert 0 < kl < 1
    print(f"{method}: {line}")


def test_orbax_in_and_out_keep_every_tensor(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    run_cli("convert", src, tmp_path / "orbax", "--to", "orbax")
    run_cli("context", tmp_path / "orbax", tmp_path / "o2o", "--to", "orbax", "--max-position", EXTENDED,
            "--rope-scaling", "llama3")
    run_cli("context", tmp_path / "orbax", tmp_path / "o2hf", "--max-position", EXTENDED, "--rope-scaling", "yarn")
    before = tensor_bytes(tmp_path / "orbax")
    assert tensor_bytes(tmp_path / "o2o") == before == tensor_bytes(tmp_path / "o2hf")
    spec = read_checkpoint(tmp_path / "o2o").spec
    assert spec.max_position_embeddings == EXTENDED and spec.rope_scaling_dict["rope_type"] == "llama3"
    ids = random_ids(1, PROBE, seed=4)
    assert np.abs(ours(tmp_path / "o2hf", ids) - logits(tmp_path / "o2hf", ids)).max() <= TOL


def test_a_longer_window_alone_preserves_the_function(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    proc = run_cli("context", src, tmp_path / "out", "--max-position", EXTENDED)
    assert "verified: same function" in proc.stderr and "RoPE changed" not in proc.stderr
    assert tensor_bytes(tmp_path / "out") == tensor_bytes(src)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["max_position_embeddings"] == EXTENDED and cfg["rope_scaling"] is None


def test_replace_scaling_keeps_the_original_length(tmp_path):
    scaled = make_tiny("llama", tmp_path / "scaled", rope_parameters={
        "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128, "rope_theta": 10000.0})
    refused = run_cli("context", scaled, tmp_path / "out", "--max-position", EXTENDED, "--rope-scaling", "yarn",
                      check=False)
    assert_clean_failure(refused, mentions="--replace-scaling")
    assert not leftovers(tmp_path, "out")
    run_cli("context", scaled, tmp_path / "out", "--max-position", EXTENDED, "--rope-scaling", "yarn",
            "--replace-scaling")
    scaling = json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                       "beta_fast": 32.0, "beta_slow": 1.0}


def test_force_shorter(tiny_dir, tmp_path):
    run_cli("context", tiny_dir("llama"), tmp_path / "out", "--max-position", 128, "--force-shorter")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == 128
    proc = run_cli("context", tiny_dir("llama"), tmp_path / "theta", "--max-position", 128, "--force-shorter",
                   "--rope-theta", "1e6")
    assert "within the original 128 positions, against the source on 1 × 128 probe tokens: KL" in proc.stderr


@pytest.mark.parametrize("args,mentions", [
    (["--max-position", "256"], "--force-shorter"),
    (["--max-position", "128", "--rope-scaling", "linear"], "--force-shorter"),
    (["--max-position", "1024", "--rope-scaling", "linear", "--factor", "1"], "--factor 1 is not a scaling factor"),
    (["--max-position", "1024", "--rope-scaling", "linear", "--factor", "1e308"], "--factor 1e+308 is above 1e+06"),
    (["--max-position", "1024", "--rope-scaling", "yarn", "--factor", "0.5"], "--factor 0.5"),
    (["--max-position", "256", "--force-shorter", "--rope-scaling", "linear"], "not a scaling factor above 1"),
    (["--max-position", "1024", "--rope-theta", "0"], "--rope-theta 0"),
    (["--max-position", "1024", "--rope-theta", "-5"], "--rope-theta -5"),
    (["--max-position", "1024", "--factor", "4"], "needs --rope-scaling"),
    (["--max-position", "1024", "--replace-scaling"], "needs --rope-scaling"),
    (["--max-position", "1024", "--rope-scaling", "linear", "--beta-fast", "8"], "--beta-fast is not an option"),
    (["--max-position", "1024", "--rope-scaling", "yarn", "--high-freq-factor", "8"], "--high-freq-factor"),
    (["--max-position", "1024", "--rope-scaling", "yarn", "--original-max-position", "2048"], "is above"),
    (["--max-position", "1024", "--rope-scaling", "yarn", "--beta-slow", "64"], "beta_slow < beta_fast"),
    (["--max-position", "1024", "--rope-scaling", "llama3", "--low-freq-factor", "4"], "low_freq_factor <"),
    (["--max-position", "1024", "--rope-scaling", "dynamic"], "--rope-scaling"),
    (["--max-position", "1024", "--rope-theta", "nan"], "--rope-theta"),
])
def test_refusals_are_one_line_and_write_nothing(args, mentions, tiny_dir, tmp_path):
    proc = run_cli("context", tiny_dir("llama"), tmp_path / "out", *args, check=False)
    assert_clean_failure(proc, mentions=mentions)
    assert proc.returncode == 2 and not leftovers(tmp_path, "out")


def test_a_family_whose_loaders_lack_the_scaling_is_refused(tiny_dir, tmp_path, monkeypatch):
    import dataclasses

    from transform_helpers import run_transform

    from upcycler.families import family_named
    from upcycler.transforms import context as module

    narrow = dataclasses.replace(family_named("llama"), rope_scalings=("linear",))
    monkeypatch.setattr(module, "family_named", lambda name: narrow)
    with pytest.raises(UpcyclerError, match="not loaded with rope_scaling yarn .*; use one of linear"):
        run_transform("context", tiny_dir("llama"), tmp_path / "out", max_position=EXTENDED, rope_scaling="yarn")
    assert not leftovers(tmp_path, "out")


def test_dry_run_prints_the_new_fields_and_writes_nothing(tiny_dir, tmp_path):
    proc = run_cli("context", tiny_dir("llama"), tmp_path / "out", "--max-position", EXTENDED, "--rope-scaling",
                   "yarn", "--dry-run")
    assert '"rope_type": "yarn"' in proc.stdout and "max_position_embeddings 1024" in proc.stdout
    assert "NOT preserved" in proc.stdout and not leftovers(tmp_path, "out")
    planned = json.loads(run_cli("context", tiny_dir("llama"), "--max-position", EXTENDED, "--rope-scaling",
                                 "llama3", "--dry-run", "--json").stdout)
    assert planned["config"]["rope_scaling"]["rope_type"] == "llama3"
    assert planned["config"]["max_position_embeddings"] == EXTENDED


def test_no_verify_skips_the_measurement_and_a_recipe_runs_the_step(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    proc = run_cli("context", src, tmp_path / "out", "--max-position", EXTENDED, "--rope-scaling", "linear",
                   "--no-verify")
    assert "not measured: --no-verify" in proc.stderr and " KL " not in proc.stderr
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"source: {src}\ntransforms:\n  - context: {{max_position: {EXTENDED}, rope_scaling: yarn}}\n"
                      f"output: {{path: {tmp_path / 'run'}}}\n")
    proc = run_cli("run", recipe)
    assert KL_LINE in proc.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["rope_scaling"]["rope_type"] == "yarn"
