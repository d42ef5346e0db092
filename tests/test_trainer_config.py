"""The training config: schema round trip, flag overrides, LR schedule, bad configs refused up front."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import trainer_fixtures as F
from click.testing import CliRunner
from xla_flags import with_devices

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.train.config import OptimizerConfig, SchedulePhase, TrainConfig, load_config
from upcycler.train.loop.optim import make_schedule
from upcycler.train.loop.preflight import resumes


def test_config_round_trip_and_overrides(ws, tmp_path):
    path = F.write_config(tmp_path / "train.yaml", F.config_dict(tmp_path, ws["dense"], ws["data"]))
    config = load_config(
        path,
        {"steps": 9, "model.tokenizer": str(ws["tokenizer"])},
        ["optimizer.lr=1e-4", "mesh.fsdp=1", "checkpoint.async=false"],
    )
    assert (config.steps, config.optimizer.lr, config.mesh.fsdp, config.checkpoint.async_save) == (
        9,
        1e-4,
        1,
        False,
    )
    assert config.model.tokenizer == ws["tokenizer"]
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_schedule_is_joined_from_phases_in_absolute_steps():
    o = OptimizerConfig(
        lr=1.0,
        schedule=(
            SchedulePhase("warmup", 4),
            SchedulePhase("constant", 6),
            SchedulePhase("linear", 10, 0.2),
            SchedulePhase("cosine", 14, 0.0),
        ),
    )
    lr = np.array([float(make_schedule(o)(s)) for s in range(16)])
    np.testing.assert_allclose(lr[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    np.testing.assert_allclose(lr[4:6], 1.0)
    np.testing.assert_allclose(lr[6:10], [0.8, 0.6, 0.4, 0.2], rtol=1e-6)
    np.testing.assert_allclose(lr[10:14], 0.2 * 0.5 * (1 + np.cos(np.pi * np.arange(1, 5) / 4)), atol=1e-7)
    np.testing.assert_allclose(lr[14:], 0.0, atol=1e-7)
    rewarm = OptimizerConfig(lr=1.0, schedule=(SchedulePhase("constant", 2, 0.1), SchedulePhase("warmup", 4)))
    np.testing.assert_allclose(
        [float(make_schedule(rewarm)(s)) for s in range(5)], [0.1, 0.1, 0.55, 1.0, 1.0], rtol=1e-6
    )
    assert float(make_schedule(OptimizerConfig(lr=0.5))(123)) == 0.5


BAD = {
    "unknown source": ({"data.phases": [{"weights": {"json": 0.5, "wiki": 0.5}}]}, "'wiki'"),
    "weights do not sum to 1": ({"data.phases": [{"weights": {"json": 0.5, "email": 0.4}}]}, "sum to 0.9"),
    "data phases out of order": (
        {
            "data.phases": [
                {"until_step": 5, "weights": {"json": 1.0}},
                {"until_step": 3, "weights": {"json": 1.0}},
                {"weights": {"email": 1.0}},
            ]
        },
        "until_step is 3",
    ),
    "lr phases out of order": (
        {"optimizer.schedule": [{"kind": "warmup", "until_step": 10}, {"kind": "cosine", "until_step": 10}]},
        "schedule[1].until_step",
    ),
    "unknown phase kind": (
        {"optimizer.schedule": [{"kind": "exponential", "until_step": 10}]},
        "exponential",
    ),
    "batch not divisible by the mesh": ({"mesh.fsdp": 3}, "not divisible by the mesh"),
    "missing tokenizer": ({"model.tokenizer": "nowhere/tokenizer.json"}, "no tokenizer"),
    "unknown key": ({"optimizer.learning_rate": 1.0}, "'learning_rate'"),
    "compressed combine without expert parallelism": ({"model.comm_dtype": "bf16"}, "model.moe_dispatch"),
    "unknown dispatch": ({"model.moe_dispatch": "ring"}, "'ring'"),
    "token chunks without the all_gather dispatch": ({"model.moe_chunks": 2}, "model.moe_dispatch"),
    "token chunks that do not divide the gathered tokens": (
        {"model.moe_dispatch": "all_gather", "model.moe_chunks": 3}, "model.moe_chunks 3"),
    "NaN chunk count": ({"model.moe_chunks": float("nan")}, "model.moe_chunks"),
    "sparse prefill attention for training": ({"model.attention": "flexprefill"}, "upcycle eval"),
    "a prefill option in a training config": ({"model.prefill_gamma": 0.5}, "'prefill_gamma'"),
    "an HF export no saved step reaches": ({"checkpoint.hf_every": 5}, "checkpoint.hf_every 5 exports no step"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_fails_with_one_line_before_running(ws, tmp_path, case):
    changes, mentions = BAD[case]
    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], **changes)
    path = F.write_config(tmp_path / "train.yaml", cfg)
    result = CliRunner().invoke(main, ["continued-pretrain", "--config", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and mentions in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_checkpoint_without_tokenizer_is_refused(ws, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(ws["dense"], bare, ignore=shutil.ignore_patterns("tokenizer*"))
    path = F.write_config(tmp_path / "train.yaml", F.config_dict(tmp_path, bare, ws["data"]))
    with pytest.raises(UpcyclerError, match="no tokenizer; set model.tokenizer"):
        from upcycler.train.loop.trainer import prepare

        prepare(load_config(path), resume=False)


def test_devices_that_do_not_split_the_batch_are_refused(ws, tmp_path):
    path = F.write_config(tmp_path / "train.yaml", F.config_dict(tmp_path, ws["dense"], ws["data"]))
    proc = F.run_cli(
        "continued-pretrain",
        "--config",
        path,
        check=False,
        env={"XLA_FLAGS": with_devices(3)},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.global_batch_size 8 is not divisible")
    assert not (tmp_path / "run").exists()


def test_resume_modes_decide_from_the_committed_checkpoints(ws, tmp_path):
    """auto (the default) resumes exactly when run_dir holds a checkpoint; always (a bare --resume) needs
    one; never refuses one. The refusals happen before anything is written."""
    full = F.config_dict(tmp_path, ws["dense"], ws["data"])
    (tmp_path / "run" / "4").mkdir(parents=True)
    fresh = F.config_dict(tmp_path / "new", ws["dense"], ws["data"])
    config = TrainConfig.from_dict(full)
    assert resumes(config, "auto") and resumes(config, "always") and not resumes(config, "never")
    config = TrainConfig.from_dict(fresh)
    assert not resumes(config, "auto") and resumes(config, "always") and not resumes(config, "never")

    path = F.write_config(tmp_path / "train.yaml", full)
    result = CliRunner().invoke(main, ["continued-pretrain", "--config", str(path), "--resume", "never"])
    assert result.exit_code == 2 and "holds checkpoints of an earlier run" in result.stderr
    path = F.write_config(tmp_path / "fresh.yaml", fresh)
    result = CliRunner().invoke(main, ["continued-pretrain", "--config", str(path), "--resume"])
    assert result.exit_code == 2 and "no checkpoint to resume from" in result.stderr
    assert not (tmp_path / "new").exists()
    result = CliRunner().invoke(main, ["continued-pretrain", "--config", str(path), "--resume", "sometimes"])
    assert result.exit_code == 2 and "'sometimes' is not one of 'auto', 'always', 'never'" in result.stderr
