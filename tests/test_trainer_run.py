"""Training runs end to end on tiny models and real text: learning, upcycling, failure and export."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trainer_fixtures as F
from click.testing import CliRunner

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.train.config import TrainConfig
from upcycler.train.loop.trainer import train


def config(tmp, init, ws, **changes) -> TrainConfig:
    return TrainConfig.from_dict(F.config_dict(tmp, init, ws["data"], **changes))


@pytest.fixture(scope="module")
def moe_run(ws, tmp_path_factory):
    """The tiny qwen3_moe trained 6 steps, checkpoints at 2, 4 and 6."""
    tmp = tmp_path_factory.mktemp("moe_run")
    train(config(tmp, ws["moe"], ws))
    return tmp / "run"


def test_upcycled_moe_starts_at_its_dense_parents_loss_and_learns(ws, tmp_path):
    dense = train(config(tmp_path / "dense", ws["dense"], ws, steps=1))
    assert dense.step == 1
    upcycled = tmp_path / "upcycled"
    result = CliRunner().invoke(
        main,
        [
            "dense-to-moe",
            str(ws["dense"]),
            str(upcycled),
            "--experts",
            "8",
            "--topk",
            "4",
            "--granularity",
            "4",
            "--shared-experts",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    train(config(tmp_path / "moe", upcycled, ws, steps=50, **{"checkpoint.every": 50}))
    parent, child = F.metrics(tmp_path / "dense" / "run"), F.metrics(tmp_path / "moe" / "run")
    np.testing.assert_allclose(child[0]["loss"], parent[0]["loss"], rtol=1e-5)
    assert [r["step"] for r in child] == list(range(50))
    losses = np.array([r["loss"] for r in child])
    assert losses[-5:].mean() < losses[0] - 1.0, losses
    assert all(0.99 < r["lb_loss"] < 2.0 and r["z_loss"] > 0 for r in child)
    load = np.array(child[-1]["expert_load"])
    assert load.shape == (2, 8) and np.allclose(load.sum(axis=1), 1.0, atol=1e-4)


def test_non_finite_loss_stops_naming_the_step_and_last_good_checkpoint(ws, tmp_path):
    cfg = config(
        tmp_path,
        ws["dense"],
        ws,
        **{"optimizer.lr": 1e30, "optimizer.schedule": [], "checkpoint.every": 1, "optimizer.clip_norm": 0.0},
    )
    with pytest.raises(UpcyclerError) as err:
        train(cfg)
    message = str(err.value)
    assert (
        "at step 1" in message and f"last good checkpoint is {(tmp_path / 'run' / '1').absolute()}" in message
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["1"]
    assert [r["step"] for r in F.metrics(tmp_path / "run")] == [0]


def test_a_corrupted_init_is_refused_before_the_first_step(ws, tmp_path):
    import shutil

    init = tmp_path / "init"
    shutil.copytree(ws["dense"], init)
    shard = max(init.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(b ^ 0x5A for b in data[len(data) // 2: len(data) // 2 + 64])
    shard.write_bytes(bytes(data))
    with pytest.raises(UpcyclerError, match=f"{shard.name}: tensor .*: contents differ from the xxh3_128"):
        train(config(tmp_path, init, ws))
    run = tmp_path / "run"
    assert not run.exists() or not [p for p in run.iterdir() if p.name.isdigit()], "a step was committed"


def test_step_directory_converts_to_hf_and_matches_transformers(ws, moe_run, tmp_path):
    import tiny_models

    out = tmp_path / "hf"
    result = CliRunner().invoke(main, ["convert", str(moe_run / "6"), str(out), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").read_bytes() == ws["tokenizer"].read_bytes()
    lineage = json.loads((out / "upcycler.json").read_text())["lineage"]
    assert any(step.get("step") == "continued-pretrain" and step["trained_steps"] == 6 for step in lineage)
    ids = tiny_models.random_ids(2, 12, F.VOCAB)
    expected = tiny_models.logits(out, ids)
    from upcycler.train.model import ModelConfig, forward
    from upcycler.train.model.params import load_params

    spec, params = load_params(moe_run / "6")
    logits, _ = forward(params, ids, spec, ModelConfig())
    np.testing.assert_allclose(np.asarray(logits), expected, atol=2e-4)


def test_report_plots_losses_and_expert_load(moe_run, tmp_path):
    result = CliRunner().invoke(main, ["report", str(moe_run), "--out", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["expert_health.png", "expert_load_layer0.png", "expert_load_layer1.png",
                     "expert_usage_by_source.png", "goodput.png", "loss.png", "training.png"]
    assert all((tmp_path / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "metrics.jsonl: missing" in result.stderr


def test_bf16_compute_keeps_float32_master_weights(ws, tmp_path):
    train(config(tmp_path, ws["dense"], ws, steps=2, **{"model.compute_dtype": "bfloat16"}))
    losses = [r["loss"] for r in F.metrics(tmp_path / "run")]
    assert all(np.isfinite(losses)) and abs(losses[0] - np.log(F.VOCAB)) < 0.5
    params = F.step_params(tmp_path / "run" / "2")
    assert {str(a.dtype) for a in params.values()} == {"float32"}
