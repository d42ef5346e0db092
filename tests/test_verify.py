"""`upcycle verify A B`: passes on the same function, fails (exit 1) on a different one.

Cases: an exact copy, an Orbax copy, function-preserving upcycles (dense → MoE for each router family,
identity depth growth) pass; a perturbed copy and a SOLAR depth upscale fail. Most runs are in-process
(`CliRunner`), so compiled forwards are shared; one runs the real command in a subprocess.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, run_cli
from click.testing import CliRunner

from upcycler.cli import main
from upcycler.io import read_checkpoint, write_checkpoint
from upcycler.tensors import constant
from upcycler.verify import probe_ids


def verify(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["verify", *map(str, args)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def cli(*args) -> None:
    result = CliRunner().invoke(main, list(map(str, args)))
    assert result.exit_code == 0, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception


@pytest.fixture(scope="module")
def dense(tiny_dir) -> Path:
    return tiny_dir("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def perturbed(dense, tmp_path_factory) -> Path:
    """The dense model with one down_proj entry nudged by 1e-2."""
    ckpt = read_checkpoint(dense)
    w = ckpt.tensors["layers.1.mlp.down_proj"].load().copy()
    w[3, 5] += 1e-2
    out = tmp_path_factory.mktemp("perturbed") / "model"
    return write_checkpoint(
        ckpt.replace(tensors=ckpt.tensors.updated({"layers.1.mlp.down_proj": constant(w)})), out
    )


def test_exact_copy_passes(dense, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dense, copy)
    code, out = verify(dense, copy)
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("same function: max |Δlogits| 0.00e+00")
    assert "KL(A‖B)" in out and "mean |Δlogits|" in out


def test_perturbed_copy_fails(dense, perturbed):
    code, out = verify(dense, perturbed)
    assert code == 1
    assert out.strip().splitlines()[-1].startswith("different functions: max |Δlogits|")
    code, _ = verify(dense, perturbed, "--tolerance", "10")
    assert code == 0


def test_json_report(dense, perturbed):
    code, out = verify(dense, perturbed, "--json", "--tokens", "32", "--batch", "3", "--seed", "4")
    stats = json.loads(out)
    assert code == 1 and stats["passed"] is False
    assert stats["probe"] == {"batch": 3, "tokens": 32, "seed": 4, "vocab": 128}
    assert stats["max_abs_diff"] > 1e-4 and 0 < stats["mean_abs_diff"] <= stats["max_abs_diff"]
    assert stats["kl_mean"] > 0 and stats["kl_max"] >= stats["kl_mean"]
    assert (
        stats["a"]["family"] == "llama" and stats["a"]["params"] == read_checkpoint(dense).spec.total_params()
    )


def test_probe_is_seeded_and_inside_the_vocabulary():
    a, b = probe_ids(50, batch=2, tokens=64, seed=3), probe_ids(50, batch=2, tokens=64, seed=3)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 64) and a.min() >= 0 and a.max() < 50
    assert not np.array_equal(a, probe_ids(50, batch=2, tokens=64, seed=4))


def test_orbax_copy_passes(dense, tmp_path):
    out = tmp_path / "orbax"
    cli("convert", dense, out, "--to", "orbax")
    code, text = verify(dense, out)
    assert code == 0, text


@pytest.mark.parametrize(
    "args",
    [
        ["--experts", "8", "--topk", "4", "--granularity", "4"],  # Mixtral, renormalising router
        [
            "--experts",
            "6",
            "--topk",
            "3",
            "--granularity",
            "4",
            "--shared-experts",
            "1",
            "--dense-layers",
            "1",
            "--target",
            "qwen2_moe",
        ],  # gated shared expert, dense first layer
        [
            "--experts",
            "6",
            "--topk",
            "3",
            "--granularity",
            "4",
            "--shared-experts",
            "1",
            "--dense-layers",
            "1",
            "--target",
            "glm4_moe",
            "--routed-scaling-factor",
            "2.5",
        ],  # sigmoid router
    ],
    ids=["mixtral", "qwen2_moe-shared-dense", "glm4_moe-sigmoid"],
)
def test_function_preserving_upcycle_passes(dense, tmp_path, args):
    out = tmp_path / "moe"
    cli("dense-to-moe", dense, out, *args)
    spec = read_checkpoint(out).spec
    assert spec.moe.router == ("sigmoid" if "glm4_moe" in args else "renormalized")
    assert bool(spec.moe.shared_width) == ("--shared-experts" in args)
    assert len(spec.dense_layers) == (1 if "--dense-layers" in args else 0)
    code, text = verify(dense, out)
    assert code == 0, text


def test_identity_depth_passes_and_solar_fails(dense, tmp_path):
    cli("depth", dense, tmp_path / "identity", "--method", "identity", "--layers", "6")
    code, text = verify(dense, tmp_path / "identity")
    assert code == 0, text
    cli("depth", dense, tmp_path / "solar", "--method", "solar", "--layers", "6")
    code, text = verify(dense, tmp_path / "solar")
    assert code == 1, text
    assert text.strip().splitlines()[-1].startswith("different functions")


def test_command_line_exit_codes(dense, perturbed, tmp_path):
    ok = run_cli("verify", dense, dense)
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1].startswith("same function")
    bad = run_cli("verify", dense, perturbed, check=False)
    assert bad.returncode == 1 and bad.stdout.strip().splitlines()[-1].startswith("different functions")
    missing = run_cli("verify", dense, tmp_path / "nowhere", check=False)
    assert_clean_failure(missing, mentions="nowhere")


def test_unrunnable_model_is_a_clean_error(dense, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(dense, odd)
    config = json.loads((odd / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (odd / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["verify", str(dense), str(odd)])
    assert (
        result.exit_code == 2 and "cannot run this checkpoint" in result.output and "dynamic" in result.output
    )
