"""The README's main job: `upcycle demo` runs end to end on the bundled model, offline."""

from __future__ import annotations

import json

import numpy as np
from cli_helpers import assert_clean_failure, run_cli
from tiny_models import logits, random_ids

from upcycler.cli.demo import demo_assets


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = run_cli("demo", "--out", out, "--steps", "4", timeout=900)
    assert "same function" in proc.stdout  # verify passed on the upcycled model
    moe_config = json.loads((out / "moe" / "config.json").read_text())
    assert moe_config["architectures"] == ["Qwen2MoeForCausalLM"] and moe_config["mlp_only_layers"] == [0]
    ids = random_ids(batch=2, length=32, vocab=2048)
    np.testing.assert_allclose(logits(out / "moe", ids), logits(demo_assets() / "model", ids), atol=1e-4, rtol=0)
    final = logits(out / "final-hf", ids)
    assert np.isfinite(final).all() and not np.allclose(final, logits(out / "moe", ids), atol=1e-3)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m][:4] == [0, 1, 2, 3]
    assert list((out / "run" / "report").glob("*.png"))
    # held-out loss of every source after the last step, and the same run in TensorBoard
    assert {k for k in metrics[-1] if k.startswith("eval/loss/")} == {
        f"eval/loss/{n}.heldout" for n in ("code", "prose", "math")}
    assert (out / "run" / "report" / "heldout.png").exists()
    assert list((out / "run" / "tensorboard").glob("events.out.tfevents.*"))
    lineage = [step["step"] for step in json.loads((out / "final-hf" / "upcycler.json").read_text())["lineage"]]
    assert "merge" in lineage
    # run again over it with --overwrite: every step replaces its output and the training starts afresh
    run_cli("demo", "--out", out, "--steps", "3", "--overwrite", timeout=900)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [0, 1, 2]  # a new run, not the old one continued


def test_demo_steps_too_few_for_its_schedule_are_refused(tmp_path):
    proc = run_cli("demo", "--out", tmp_path / "demo", "--steps", "2", check=False)
    assert_clean_failure(proc, mentions="--steps")
    assert not (tmp_path / "demo").exists()


def test_demo_refuses_existing_output(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "mine.txt").write_text("keep")
    proc = run_cli("demo", "--out", tmp_path / "demo", check=False)
    assert_clean_failure(proc, mentions="--overwrite")
    assert (tmp_path / "demo" / "mine.txt").read_text() == "keep"
