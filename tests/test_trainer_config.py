"""The training config: schema round trip, flag overrides, LR schedule, bad configs refused up front."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time

import gcs_emulator
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


def _long_phase(shape: dict) -> dict:
    """Config changes: a second data phase (from step 3) with the shape options `shape`."""
    return {"data.phases": [{"until_step": 3, "weights": {"json": 1.0}}, {"weights": {"json": 1.0}, **shape}]}


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
    "sparse prefill attention for training": ({"model.attention": "flexprefill"}, "'flexprefill'"),
    "a prefill option in a training config": ({"model.prefill_gamma": 0.5}, "'prefill_gamma'"),
    "an HF export no saved step reaches": ({"checkpoint.hf_every": 5}, "checkpoint.hf_every 5 exports no step"),
    "a phase longer than the model's positions": (_long_phase({"seq_len": 512}), "run `upcycle context`"),
    "a sequence longer than the model's positions": ({"data.seq_len": 512}, "data.seq_len 512 is beyond"),
    "a phase of no length": (_long_phase({"seq_len": 0}), "data.phases[1].seq_len"),
    "a phase whose tokens per step do not make whole rows": (
        _long_phase({"seq_len": 48, "batch": "keep_tokens"}), "cannot keep 256 tokens per step"),
    "a phase batch the mesh cannot split": (
        {**_long_phase({"global_batch_size": 6}), "data.microbatches": 4},
        "data.phases[1] global_batch_size 6 is not divisible by the mesh"),
    "a phase length the attention blocks do not divide": (
        {**_long_phase({"seq_len": 48}), "model.attention": "chunked", "model.attention_chunk": 32},
        "model.attention_chunk 32 does not divide data.phases[1] seq_len 48"),
    "the ring exchange without the splash kernel": (
        {"mesh.context": 2, "mesh.fsdp": 1, "model.context_exchange": "ring"}, "model.context_exchange ring"),
    "keep_tokens beside a batch of its own": (
        _long_phase({"seq_len": 64, "batch": "keep_tokens", "global_batch_size": 4}), "drop one of them"),
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


def test_phases_of_their_own_length_round_trip_and_resolve(ws, tmp_path):
    phases = [{"until_step": 3, "weights": {"json": 1.0}},
              {"until_step": 5, "weights": {"json": 1.0}, "seq_len": 64, "batch": "keep_tokens"},
              {"weights": {"email": 1.0}, "seq_len": 128, "global_batch_size": 4}]
    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], **{"data.phases": phases, "eval.seq_len": "phase"})
    config = TrainConfig.from_dict(cfg)
    assert TrainConfig.from_dict(config.to_dict()) == config and config.eval.seq_len == "phase"
    assert config.data.shapes == ((32, 8), (64, 4), (128, 4)) and config.data.longest_shape() == (128, 4)
    assert [config.data.tokens_before(s) for s in (3, 5, 7)] == [768, 1280, 1280 + 1024]
    from upcycler.train.loop.phases import at_longest

    compiled = at_longest(config)
    assert (compiled.data.seq_len, compiled.data.global_batch_size, compiled.data.phased) == (128, 4, False)
    assert [p.weights for p in compiled.data.phases] == [p.weights for p in config.data.phases]


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


# --- one run per run_dir ---------------------------------------------------------------------------

IN_USE = re.compile(r"in use by another run \(host \S+, pid \d+, since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\); wait "
                    r"for it to end or use another run_dir")


def _one_run_each_time(rounds: list[list[list[str]]]) -> None:
    for outcomes in rounds:
        assert sorted(status for status, _ in outcomes) == ["ok", "refused"], outcomes
        [line] = [detail for status, detail in outcomes if status == "refused"]
        assert IN_USE.search(line) and "\n" not in line, line


def test_two_runs_on_one_run_dir_one_is_refused_every_time(tmp_path):
    """`lock_run_dir` raced by two processes started at once, 20 times: one holds run_dir, the other is
    refused in one line naming it; the lock file is gone once the run is done."""
    from lock_racers import race

    _one_run_each_time(race("run_dir", 20, run_dir=f"{tmp_path}/r{{round}}"))
    assert all(sorted(p.name for p in (tmp_path / f"r{k}").iterdir()) == [] for k in range(20))


# 20 rounds against the emulator, about 90 s: the winner holds run_dir longer than a lease lasts, so the loser's
# watch for a renewal (at most one lease) always ends while the winner lives, however loaded the machine;
# a shorter hold lets a loser that is slowed past the winner's release take run_dir over, serially
@pytest.mark.heavy
@pytest.mark.skipif(not gcs_emulator.is_running(), reason="the run's storage emulator is not set")
def test_two_runs_on_one_bucket_run_dir_one_is_refused_every_time():
    from lock_racers import race

    _one_run_each_time(race("run_dir", 20, run_dir=gcs_emulator.unique_prefix("run-race") + "/r{round}", lease=3.0,
                            hold=4.5))


HOLD_RUN_DIR = """
import sys, time
from types import SimpleNamespace
from upcycler.io import bucket_lease, lock_holder
if sys.argv[2].endswith("elsewhere"):
    lock_holder.here = lambda: "another machine"
from upcycler.locations import location
from upcycler.train.loop.run_dir import lock_run_dir
bucket_lease.LEASE_SECONDS = 2.0
held = lock_run_dir(SimpleNamespace(run_dir=location(sys.argv[1], "run_dir")), resume=False)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("where", ["local", "bucket", "bucket-elsewhere"])
def test_the_run_dir_of_a_killed_run_is_taken_over(tmp_path, where):
    """A run killed (SIGKILL) while it holds run_dir: while it lived the next run was refused, naming it;
    once it is dead its restart takes run_dir over: on a disk, and in a bucket from the same machine, at
    once; from another machine, once the dead run's lease has expired (the restart waits for that)."""
    from types import SimpleNamespace

    from upcycler.locations import location
    from upcycler.train.loop.run_dir import lock_run_dir

    if where != "local" and not gcs_emulator.is_running():
        pytest.skip("the run's storage emulator is not set")
    run_dir = str(tmp_path / "run") if where == "local" else gcs_emulator.unique_prefix("killed-run") + "/run"
    config = SimpleNamespace(run_dir=location(run_dir, "run_dir"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_DIR, run_dir, where], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(UpcyclerError, match=rf"in use by another run \(host \S+, pid {holder.pid}, since"):
            lock_run_dir(config, resume=False)
    finally:
        holder.kill()
        holder.wait()
    killed = time.time()
    lock_run_dir(config, resume=False).close()
    took = time.time() - killed
    assert took > 1.5 if where == "bucket-elsewhere" else took < 1.5, took


def test_a_run_that_finds_checkpoints_once_it_holds_run_dir_is_refused(ws, tmp_path):
    """A run that decided to start afresh (no checkpoint when it looked) and finds one once it holds the
    lock (a run that ended meanwhile wrote it) is refused as if it had seen it, and releases the lock."""
    from types import SimpleNamespace

    from upcycler.train.loop.run_dir import lock_run_dir

    (tmp_path / "run" / "4").mkdir(parents=True)
    config = SimpleNamespace(run_dir=tmp_path / "run")
    with pytest.raises(UpcyclerError, match="holds checkpoints of an earlier run .written after this run started"):
        lock_run_dir(config, resume=False)
    lock_run_dir(config, resume=True).close()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["4"]


@pytest.mark.heavy  # two training runs at once: about a minute
def test_two_continued_pretrain_runs_on_one_run_dir_one_is_refused(ws, tmp_path):
    """The full CLI: two `continued-pretrain` runs on one run_dir at once: one trains to the end (its metrics
    hold each step once), the other exits 2 with one line naming it (or, had it started after the first
    ended, refusing its checkpoints)."""
    path = F.write_config(tmp_path / "train.yaml", F.config_dict(tmp_path, ws["dense"], ws["data"]))
    procs = [subprocess.Popen([sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(path),
                               "--resume", "never"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = [(proc.wait(timeout=900), proc.stderr.read()) for proc in procs]
    assert sorted(status for status, _ in done) == [0, 2], done
    [loser] = [stderr for status, stderr in done if status == 2]
    lines = [line for line in loser.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and (IN_USE.search(lines[0]) or "holds checkpoints of an earlier run" in lines[0]), loser
    assert [m["step"] for m in F.metrics(tmp_path / "run")] == list(range(6))
    assert not (tmp_path / "run" / ".upcycler-lock").exists()
