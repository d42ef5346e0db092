"""`upcycle verify A B`: passes on the same function, fails (exit 1) on a different one.

Cases: an exact copy, an Orbax copy, function-preserving upcycles (dense → MoE for each router family,
identity depth growth) pass; a perturbed copy, a SOLAR depth upscale and the bad conversions of
`bad_variants` (dropped expert, swapped gate/up, permuted RoPE halves, one layer × 2) fail, naming the
first layer that differs. Every function-preserving write checks itself before its rename; a failed
check, a tensor missing from the written shards and a transform that loses a tensor leave nothing. Most runs are in-process
(`CliRunner`), so compiled forwards are shared; one runs the real command in a subprocess.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from bad_variants import VARIANTS, write_variant
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


# --- bad conversions fail, naming where they start -------------------------------------------------------
@pytest.fixture(scope="module")
def upcycled(dense, tmp_path_factory) -> Path:
    """An exact upcycle of the 4-layer dense model: 16 experts in groups of 4, top-4."""
    out = tmp_path_factory.mktemp("upcycled") / "moe"
    cli("dense-to-moe", dense, out, "--experts", "16", "--topk", "4", "--granularity", "4")
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_conversions_fail_and_name_the_layer(dense, upcycled, tmp_path, variant):
    code, text = verify(dense, upcycled)
    assert code == 0, text
    bad = write_variant(upcycled, tmp_path / "bad", variant, layer=2)
    code, text = verify(dense, bad)
    verdict_line = text.strip().splitlines()[-1]
    assert code == 1 and verdict_line.startswith("different functions"), text
    assert "first layer over its noise floor: 2" in verdict_line


def test_verdict_states_its_criterion_and_tolerance_is_absolute(dense, upcycled, perturbed):
    code, text = verify(dense, upcycled, "--json")
    stats = json.loads(text)
    assert code == 0 and stats["passed"] and stats["tolerance"] is None
    assert 0 < stats["noise_floor"] and stats["max_abs_diff"] <= 10 * stats["noise_floor"]
    assert stats["top1_agreement"] == 1.0 and len(stats["layers"]) == 4
    assert "10 × A's fp32 noise floor" in stats["verdict"] and "KL" in stats["verdict"]
    code, text = verify(dense, perturbed, "--tolerance", "1e9")
    assert code == 0 and "--tolerance 1.0e+09 (absolute)" in text
    if stats["max_abs_diff"] > 0:
        code, text = verify(dense, upcycled, "--tolerance", "0")
        assert code == 1, text


# --- the check after every function-preserving write ------------------------------------------------------
def test_exact_writes_record_their_check(dense, upcycled, tmp_path):
    record = json.loads((upcycled / "upcycler.json").read_text())["verification"]
    assert record["passed"] and record["against"] == dense.name
    assert record["method"] == "in-stream" and record["moe_layers"] == 4  # dense-to-moe: tests/test_moe_write_check.py
    from upcycler.model_card import render_model_card

    card = render_model_card(upcycled)
    assert "Verdict: `same function: every tensor holds the bytes it should" in card
    cli("convert", upcycled, tmp_path / "orbax", "--to", "orbax")  # other writes: the full check on a probe
    record = json.loads((tmp_path / "orbax" / "upcycler.json").read_text())["verification"]
    assert record["passed"] and record["against"] == upcycled.name
    assert record["max_abs_logit_diff"] <= record["allowed"] == pytest.approx(10 * max(
        record["noise_floor"], 2**-23 * record["logit_scale"]))
    assert record["top1_agreement"] == 1.0 and record["kl_mean"] < 1e-9
    cli("depth", dense, tmp_path / "deep", "--layers", "6")
    assert json.loads((tmp_path / "deep" / "upcycler.json").read_text())["verification"]["passed"]


def test_unchecked_writes_say_why(dense, tmp_path):
    proc = run_cli("dense-to-moe", dense, tmp_path / "moe", "--experts", "8", "--topk", "2", "--no-verify")
    assert "not verified: --no-verify" in proc.stderr
    assert "verification" not in json.loads((tmp_path / "moe" / "upcycler.json").read_text())
    proc = run_cli("convert", dense, tmp_path / "bf16", "--dtype", "bf16")
    assert "not verified: --dtype bf16 rounds the float32 weights" in proc.stderr
    proc = run_cli("depth", dense, tmp_path / "solar", "--method", "solar", "--layers", "6")
    assert "not verified: the recipe does not preserve the function" in proc.stderr


def test_a_failed_check_leaves_nothing(dense, tmp_path, monkeypatch):
    """A transform that claims exactness but computes something else: the write is refused and removed."""
    from upcycler.transforms import dense_to_moe

    original = dense_to_moe.scale_columns
    monkeypatch.setattr(dense_to_moe, "scale_columns",
                        lambda w, factor, *dtype: original(w, np.asarray(factor) * 2, *dtype))
    result = CliRunner().invoke(main, list(map(str, ["dense-to-moe", dense, tmp_path / "moe", "--experts", "8",
                                                     "--topk", "2", "--granularity", "2"])))
    assert result.exit_code == 2
    assert "claims to preserve the function, but the written model does not" in result.output
    assert "layer 0: routed expert 0's down_proj" in result.output and "--no-verify" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_tensor_missing_from_the_written_shards_is_refused(dense, tmp_path, monkeypatch):
    from transform_helpers import run_transform

    from upcycler.errors import UpcyclerError
    from upcycler.io import hf_write

    original = hf_write._write_shards

    def lose_one_expert(tmp, shards, total, progress, *written):  # a writer bug: one expert never reaches its shard
        shards = [[i for i in shard if i.name != "model.layers.1.block_sparse_moe.experts.5.w2.weight"]
                  for shard in shards]
        return original(tmp, shards, total, progress, *written)

    monkeypatch.setattr(hf_write, "_write_shards", lose_one_expert)
    with pytest.raises(UpcyclerError, match=r"tensor model\.layers\.1\.block_sparse_moe\.experts\.5\.w2\.weight "
                                            r"is missing from the written output"):
        run_transform("dense-to-moe", dense, tmp_path / "moe", experts=8, topk=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_transform_must_account_for_every_tensor(dense):
    from dataclasses import dataclass

    from upcycler.errors import UpcyclerError
    from upcycler.transforms.registry import Transform

    @dataclass(frozen=True)
    class Nothing:
        pass

    ckpt = read_checkpoint(dense)
    leaky = Transform("leaky", Nothing, lambda cfg, spec, tensors, context: (spec, tensors.updated(
        {"layers.0.mlp.old_proj": tensors["layers.0.mlp.up_proj"]})))
    with pytest.raises(UpcyclerError, match=r"leaky produced .*tensor layers\.0\.mlp\.old_proj is not part of"):
        leaky.apply(Nothing(), ckpt.spec, ckpt.tensors)
    lossy = Transform("lossy", Nothing, lambda cfg, spec, tensors, context: (
        spec, tensors.without(["layers.3.attn.o_proj"])))
    with pytest.raises(UpcyclerError, match=r"tensor layers\.3\.attn\.o_proj of the llama model is missing"):
        lossy.apply(Nothing(), ckpt.spec, ckpt.tensors)

