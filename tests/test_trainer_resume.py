"""Exact resume: a run killed at a random step ends bit-identical to an uninterrupted one; SIGTERM saves."""

from __future__ import annotations

import json
import random
import shutil
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


def test_a_step_missing_a_data_file_is_one_line_naming_it_and_an_earlier_step_resumes(ws, cache, tmp_path):
    """A data file of step 2's params/ deleted: what reading it raises (tensorstore's bare Exception under
    Orbax's) is one line naming the step directory and the fix, with no traceback, and nothing is trained or
    saved; removed as the line says, the same command resumes from step 1."""
    from cli_helpers import assert_clean_failure

    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=2, **{"checkpoint.every": 1})
    path = F.write_config(tmp_path / "train.yaml", cfg)
    F.run_cli("continued-pretrain", "--config", path)
    run_dir, step_dir = tmp_path / "run", tmp_path / "run" / "2"
    data = max((p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    data.unlink()
    proc = F.run_cli("continued-pretrain", "--config", path, "--resume", "--steps", 3, check=False)
    line = assert_clean_failure(proc, mentions=f"{step_dir}: cannot be read (")
    assert f"resume from an earlier step (remove {step_dir})" in line and len(line) < 1000, line
    assert sorted(committed_steps(run_dir)) == [1, 2] and len(F.metrics(run_dir)) == 2
    shutil.rmtree(step_dir)
    resumed = F.run_cli("continued-pretrain", "--config", path, "--resume", "--steps", 3)
    assert "finished at step 3" in resumed.stdout and sorted(committed_steps(run_dir)) == [1, 2, 3]


PHASED_STEPS = 6


def phased(tmp, ws, **changes) -> TrainConfig:
    """Three steps of 8 rows of 32 tokens, then 4 rows of 64 (the same tokens per step), the learning rate
    in steps; held-out loss at each phase's length."""
    phases = [{"until_step": 3, "weights": {"json": 0.75, "email": 0.25}},
              {"weights": {"json": 0.5, "email": 0.5}, "seq_len": 64, "batch": "keep_tokens"}]
    cfg = F.config_dict(tmp, ws["dense"], ws["data"], **{
        "steps": PHASED_STEPS, "data.phases": phases, "checkpoint.every": 2,
        "eval": {"every": 2, "batches": 1, "sources": ["email"], "seq_len": "phase"}, **changes})
    return TrainConfig.from_dict(cfg)


@pytest.fixture
def watched(monkeypatch):
    """Every batch the data iterator hands out ((step, inputs)), and every compile of the train step."""
    from upcycler.train.data.mix import DataIterator
    from upcycler.train.loop import train_step

    seen: dict[str, list] = {"batches": [], "compiles": []}
    plain_next, plain_compile = DataIterator.__next__, train_step.compile_step

    def next_batch(self):
        step = self.step
        batch = plain_next(self)
        seen["batches"].append((step, batch["inputs"].copy()))
        return batch

    def compile_step(step, shardings, mesh, state, batch):
        seen["compiles"].append(tuple(batch["inputs"].shape))
        return plain_compile(step, shardings, mesh, state, batch)

    monkeypatch.setattr(DataIterator, "__next__", next_batch)
    monkeypatch.setattr(train_step, "compile_step", compile_step)
    return seen


def test_a_lengthening_run_compiles_once_per_phase_and_resumes_exactly_across_the_boundary(ws, cache, tmp_path,
                                                                                          watched):
    """Uninterrupted, the run meets two shapes and compiles the step twice; each batch has its phase's
    shape. Stopped before the boundary (step 2) or after it (step 4) and resumed, it ends with the same
    parameters, bit for bit, having read the same batches, and compiles only the shapes it still meets."""
    train(phased(tmp_path / "reference", ws))
    reference = dict(watched["batches"])
    assert watched["compiles"] == [(8, 32), (4, 64)]
    assert [reference[s].shape for s in range(PHASED_STEPS)] == [(8, 32)] * 3 + [(4, 64)] * 3
    records = F.metrics(tmp_path / "reference" / "run")
    assert [s for s, r in enumerate(records) if "eval/loss/email" in r] == [1, 3, 5]
    expected = F.step_params(tmp_path / "reference" / "run" / str(PHASED_STEPS))
    for stop, compiles in ((2, [(8, 32), (4, 64)]), (4, [(4, 64)])):
        tmp = tmp_path / f"stopped-{stop}"
        train(phased(tmp, ws, steps=stop))
        watched["batches"].clear()
        watched["compiles"].clear()
        result = train(phased(tmp, ws), resume=True)
        assert result.step == PHASED_STEPS and watched["compiles"] == compiles, (stop, watched["compiles"])
        assert [s for s, _ in watched["batches"]] == list(range(stop, PHASED_STEPS))
        assert all(np.array_equal(inputs, reference[s]) for s, inputs in watched["batches"]), stop
        final = F.step_params(tmp / "run" / str(PHASED_STEPS))
        assert not [name for name in expected if not np.array_equal(expected[name], final[name])], stop
        resumed = F.metrics(tmp / "run")
        assert [r["loss"] for r in resumed] == [r["loss"] for r in records], stop


def test_held_out_batches_follow_the_phase_length(ws, tmp_path):
    """`eval.seq_len: phase` reads the held-out rows at each phase's shape; `data` (the default) at the
    section's, whatever the phase."""
    from upcycler.train.loop.heldout_eval import HeldoutEval

    config = phased(tmp_path, ws)
    heldout = HeldoutEval(config, F.tiny_spec(), _tokenizer_sha(ws), 0, 1)
    assert sorted(heldout.batches) == [(32, 8), (64, 4)]
    assert [heldout.shape(s) for s in (0, 2, 3, 5)] == [(32, 8), (32, 8), (64, 4), (64, 4)]
    assert heldout.batches[(64, 4)]["email"][0]["inputs"].shape == (4, 64)
    plain = HeldoutEval(phased(tmp_path, ws, **{"eval.seq_len": "data"}), F.tiny_spec(), _tokenizer_sha(ws), 0, 1)
    assert sorted(plain.batches) == [(32, 8)] and plain.shape(5) == (32, 8)


def _tokenizer_sha(ws) -> str:
    from upcycler.train.data.sources import open_source

    return open_source(ws["data"], "json").tokenizer_sha256
