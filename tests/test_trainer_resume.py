"""Exact resume: a run killed at a random step ends bit-identical to an uninterrupted one; SIGTERM saves."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import trainer_fixtures as F

from upcycler.train.config import TrainConfig
from upcycler.train.loop.checkpointing import committed_steps
from upcycler.train.loop.trainer import train
from upcycler.train.reporting.metrics import TIMING_FIELDS

STEPS, EVERY = 120, 10


def start(config_path, *extra):
    """The CLI run as a child process we can signal."""
    return subprocess.Popen(
        [sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(config_path), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(proc, run_dir, step, *, checkpoint: bool = True, timeout: float = 600.0) -> int:
    """Poll the metrics log until it has logged `step` (and, with `checkpoint`, a checkpoint is
    committed); returns the last logged step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        path = run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) > step and (committed_steps(run_dir) or not checkpoint):
            return len(lines) - 1
        time.sleep(0.002)
    raise AssertionError(f"no step {step} within {timeout} s")


def test_run_killed_at_a_random_step_resumes_bit_identically(ws, cache, tmp_path):
    changes = {"steps": STEPS, "checkpoint.every": EVERY}
    train(TrainConfig.from_dict(F.config_dict(tmp_path / "reference", ws["dense"], ws["data"], **changes)))
    path = F.write_config(
        tmp_path / "train.yaml", F.config_dict(tmp_path, ws["dense"], ws["data"], **changes)
    )
    run_dir = tmp_path / "run"
    kill_at = random.randrange(EVERY + 1, STEPS - 20)
    proc = start(path)
    logged = wait_for_step(proc, run_dir, kill_at)
    proc.kill()
    proc.communicate()
    killed_at = max(committed_steps(run_dir))
    assert logged < STEPS - 1 and killed_at < STEPS, f"the run was not interrupted (kill at step {kill_at})"
    text = (run_dir / "metrics.jsonl").read_text()
    before = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]  # not a line the kill tore
    resumed = F.run_cli("continued-pretrain", "--config", path)  # the same command: --resume auto continues
    assert f"finished at step {STEPS}" in resumed.stdout

    reference = F.step_params(tmp_path / "reference" / "run" / str(STEPS))
    final = F.step_params(run_dir / str(STEPS))
    different = [name for name in reference if not np.array_equal(reference[name], final[name])]
    assert not different, f"killed after step {logged} (checkpoint {killed_at}): {different[:5]} differ"
    strip = TIMING_FIELDS
    ref_log = [
        {k: v for k, v in r.items() if k not in strip} for r in F.metrics(tmp_path / "reference" / "run")
    ]
    run_log = [{k: v for k, v in r.items() if k not in strip} for r in F.metrics(run_dir)]
    assert run_log == ref_log
    # goodput across the restart: the steps computed after checkpoint `killed_at` and thrown away are
    # wasted progress; the time from the killed run's last record to the restart is recovery
    after = F.metrics(run_dir)
    thrown = [r for r in before if r["step"] >= killed_at]
    clock = after[-1]["clock"]
    assert clock["wasted_progress"] == pytest.approx(sum(r["step_time"] for r in thrown), abs=1e-4)
    assert 0 < clock["recovery"] < after[killed_at]["clock"]["wall"] - before[-1]["clock"]["wall"]
    assert after[killed_at - 1]["clock"] == next(r for r in before if r["step"] == killed_at - 1)["clock"]


def test_sigterm_saves_a_checkpoint_and_the_run_resumes_from_it(ws, cache, tmp_path):
    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=100_000, **{"checkpoint.every": 100_000})
    path = F.write_config(tmp_path / "train.yaml", cfg)
    proc = start(path)
    wait_for_step(proc, tmp_path / "run", 2, checkpoint=False)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]  # EX_TEMPFAIL: what schedulers restart on
    assert err.strip().splitlines()[-1] == "preempted: exit status 75; run the same command to continue"
    logged = len(F.metrics(tmp_path / "run"))
    assert f"stopped by SIGTERM at step {logged};" in out
    step_dir = tmp_path / "run" / str(logged)
    assert list(committed_steps(tmp_path / "run")) == [logged] and (step_dir / "upcycler.json").is_file()
    resumed = F.run_cli("continued-pretrain", "--config", path, "--resume", "--steps", logged + 2)
    assert f"finished at step {logged + 2}" in resumed.stdout
    assert [r["step"] for r in F.metrics(tmp_path / "run")] == list(range(logged + 2))
