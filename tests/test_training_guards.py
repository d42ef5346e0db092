"""Continued-pretraining safeguards and by-products on the tiny models: expert health and the collapse stop,
the loss-spike guard (stop and rewind, resumed), a run started from a merge, the in-training EMA against
`upcycle merge --method ema`, and the Hugging Face export inside the loop (against the JAX model, and
killed mid-write)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest
import trainer_fixtures as F
from tiny_models import logits as hf_logits

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.tensors import constant
from upcycler.train.config import TrainConfig
from upcycler.train.loop.trainer import train
from upcycler.train.model import ModelConfig, forward_jit
from upcycler.train.model.params import from_tensors
from upcycler.train.reporting.metrics import TIMING_FIELDS


def run(ws, root, model="dense", **changes):
    return train(TrainConfig.from_dict(F.config_dict(root, ws[model], ws["data"], **changes)))


# --- expert health -----------------------------------------------------------------------------------------
def collapsed_moe(ws, out):
    """The tiny MoE (layers 1 and 2 MoE, 4 experts, top-2) with layer 2's router zeroed: every token ties
    and goes to experts 0 and 1."""
    ckpt = read_checkpoint(ws["moe"])
    name = "layers.2.moe.router"
    zero = constant(np.zeros(ckpt.tensors[name].shape, ckpt.tensors[name].dtype))
    from upcycler.io import write_checkpoint

    return write_checkpoint(ckpt.replace(tensors=ckpt.tensors.updated({name: zero})), out, to="hf", progress=False)


def test_a_collapsed_router_shows_dead_experts_within_one_window_and_stops_the_run(ws, cache, tmp_path):
    collapsed = collapsed_moe(ws, tmp_path / "collapsed")  # and lr 0: a tie broken by any update stays a tie
    changes = {"steps": 4, "optimizer.lr": 0.0, "optimizer.schedule": [], "metrics.expert_load_every": 2}
    train(TrainConfig.from_dict(F.config_dict(tmp_path / "watch", collapsed, ws["data"], **changes)))
    health = [r["expert_health"] for r in F.metrics(tmp_path / "watch" / "run") if "expert_health" in r]
    assert health[0]["dead"] == [0, 2]  # MoE layers 1 and 2: E − k = 2 dead in the collapsed one
    assert health[0]["load_min"][1] == 0.0 and health[0]["overload"][1] == 2.0

    cfg = F.config_dict(tmp_path / "stop", collapsed, ws["data"], **changes, **{"metrics.stop_on_collapse": True,
                                                                                "checkpoint.every": 1})
    with pytest.raises(UpcyclerError) as err:
        train(TrainConfig.from_dict(cfg))
    line = str(err.value)
    assert "step 1" in line and "MoE layer 2 has 2 of 4 experts dead" in line, line  # the first window: steps 0-1
    assert str(tmp_path / "stop" / "run" / "1") in line, line


def test_health_of_a_healthy_moe(ws, cache, tmp_path):
    run(ws, tmp_path, "moe", steps=2, **{"metrics.expert_load_every": 1})
    records = F.metrics(tmp_path / "run")
    for r in records:
        h = r["expert_health"]
        assert h["dead"] == [0, 0]
        assert all(0 < e <= np.log(4) + 1e-6 for e in h["entropy"])
        np.testing.assert_allclose([min(x) for x in r["expert_load"]], h["load_min"], atol=1e-6)
        assert "bias_norm" not in h  # qwen3_moe has no selection bias


# --- the loss-spike guard ----------------------------------------------------------------------------------
SPIKE_AT = 11  # the lr of step 10 is 50: the state of step 11 is ruined


def spike_config(root, ws, action, steps=16):
    schedule = [{"kind": "constant", "until_step": 10, "lr": 3e-3}, {"kind": "constant", "until_step": 11, "lr": 50.0},
                {"kind": "constant", "until_step": 40, "lr": 3e-3}]
    return F.config_dict(root, ws["dense"], ws["data"], steps=steps, **{
        "optimizer.schedule": schedule, "checkpoint.every": 1, "checkpoint.keep": 30, "checkpoint.async": False,
        "loss.spike": {"factor": 2.0, "window": 4, "action": action, "average": 3}})


def test_spike_stop_names_the_last_good_checkpoints(ws, cache, tmp_path):
    with pytest.raises(UpcyclerError) as err:
        train(TrainConfig.from_dict(spike_config(tmp_path, ws, "stop")))
    line = str(err.value)
    assert "loss spike: loss" in line and f"at step {SPIKE_AT} is" in line, line
    assert all(str(tmp_path / "run" / str(n)) in line for n in (8, 9, 10)), line
    assert f"checkpoint(s) {SPIKE_AT} hold the spiked state" in line, line
    spike = F.metrics(tmp_path / "run")[-1]
    assert spike["step"] == SPIKE_AT and spike["spike"]["action"] == "stop"


def test_spike_rewind_continues_from_the_average_and_resumes_bit_identically(ws, cache, tmp_path):
    train(TrainConfig.from_dict(spike_config(tmp_path / "full", ws, "rewind")))
    records = F.metrics(tmp_path / "full" / "run")
    spike = next(r for r in records if "spike" in r)
    assert spike["step"] == SPIKE_AT and spike["spike"]["averaged"] == [8, 9, 10]
    run_dir = tmp_path / "full" / "run"
    assert not (run_dir / str(SPIKE_AT)).exists(), "the checkpoint of the spiked state was kept"
    rewound = F.step_params(run_dir / str(SPIKE_AT + 1))
    averaged = [F.step_params(run_dir / str(n)) for n in (8, 9, 10)]
    for name, value in rewound.items():  # sma of the three good steps, fp32 running mean
        np.testing.assert_allclose(value, sum(a[name] for a in averaged) / 3, rtol=1e-6, atol=1e-7, err_msg=name)
    last_good = next(r["loss"] for r in records if r["step"] == SPIKE_AT - 1)
    final = records[-1]["loss"]
    assert records[-1]["step"] == 15 and np.isfinite(final) and final < last_good < spike["loss"]
    lineage = read_checkpoint(run_dir / "16").lineage
    assert lineage[-2]["rewinds"] == [{"step": SPIKE_AT, "averaged": [8, 9, 10]}]

    # stopped just before the spike is seen (the guard's window comes back from the checkpoint) and
    # after the rewind, then resumed: bit for bit the same run
    strip = TIMING_FIELDS
    for stop_at in (SPIKE_AT, SPIKE_AT + 2):
        split = tmp_path / f"split{stop_at}"
        train(TrainConfig.from_dict(spike_config(split, ws, "rewind", steps=stop_at)))
        train(TrainConfig.from_dict(spike_config(split, ws, "rewind")), resume=True)
        resumed = F.step_params(split / "run" / "16")
        reference = F.step_params(run_dir / "16")
        assert all(resumed[n].tobytes() == reference[n].tobytes() for n in reference), stop_at
        assert [{k: v for k, v in r.items() if k not in strip} for r in F.metrics(split / "run")] == \
               [{k: v for k, v in r.items() if k not in strip} for r in records], stop_at
        assert read_checkpoint(split / "run" / "16").lineage[-2]["rewinds"] == lineage[-2]["rewinds"]


# --- what a checkpoint's meta gives back to the techniques ---------------------------------------------------
@pytest.fixture(scope="module")
def saved_moe(ws, tmp_path_factory):
    """A tiny MoE run of 2 steps, checkpointed after each: checkpoint 1 holds an open expert window (the
    windows are 4 steps) and no rewinds."""
    root = tmp_path_factory.mktemp("saved-moe")
    run(ws, root, "moe", steps=2, **{"checkpoint.every": 1, "metrics.expert_load_every": 4})
    return root / "run"


def resumed_from(saved_moe, ws, root, step, edit, steps=3):
    """A copy of `saved_moe` that resumes from checkpoint `step` (later ones removed), its meta changed by
    `edit` (the meta as a dict, changed in place), resumed to `steps`."""
    shutil.copytree(saved_moe, root / "run")
    for later in range(step + 1, 3):
        shutil.rmtree(root / "run" / str(later))
    path = root / "run" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    return train(TrainConfig.from_dict(F.config_dict(root, ws["moe"], ws["data"], steps=steps, **{
        "checkpoint.every": 1, "metrics.expert_load_every": 4})), resume=True)


def _set(key, value, field=None):
    """An edit of the meta: `key` (or its `field`) set to `value`."""
    def edit(meta):
        if field is None:
            meta[key] = value
        else:
            meta[key][field] = value
    return edit


LYING_META = {
    "rewinds: 5": (_set("rewinds", 5), "meta rewinds is not a list of rewinds"),
    "rewinds of garbage": (_set("rewinds", ["x", {"step": "y"}]), "meta rewinds[0] is not a rewind"),
    "a rewind's step is text": (_set("rewinds", [{"step": "y", "averaged": [0]}]),
                                "meta rewinds[0].step is not an integer from 0 to 0"),
    "a rewind after the checkpoint": (_set("rewinds", [{"step": 7, "averaged": [3]}]),
                                      "meta rewinds[0].step is not an integer from 0 to 0"),
    "expert counts of 1 layer × 3 experts": (_set("expert_window", [[1, 2, 3]], "counts"),
                                             ("meta expert_window.counts is not counts (integers ≥ 0) of shape "
                                             "[MoE layers × experts] = [2, 4]")),
    "expert counts of 4 layers × 2 experts": (_set("expert_window", [[1, 2]] * 4, "counts"),
                                              "meta expert_window.counts is not counts"),
    "negative expert counts": (_set("expert_window", [[-1, 2, 3, 4]] * 2, "counts"),
                               "meta expert_window.counts is not counts"),
    "expert counts by source of another shape": (_set("expert_window", [[[1, 2, 3, 4]]] * 2, "by_source"),
                                                  ("meta expert_window.by_source is not counts (integers ≥ 0) of "
                                                  "shape [MoE layers × sources × experts] = [2, 2, 4]")),
    "entropy of text": (_set("expert_window", ["a", "b"], "entropy"), "meta expert_window.entropy"),
    "a window of 0 steps": (_set("expert_window", 0, "steps"), "meta expert_window.steps"),
    "a window that is a list": (_set("expert_window", [1]), "meta expert_window is not an open window"),
    "another step": (_set("step", 5), "meta step is not 1"),
    "lineage of text": (_set("lineage", "x"), "meta lineage is not a non-empty list"),
}


@pytest.mark.parametrize("case", list(LYING_META))
def test_a_checkpoint_whose_meta_lies_is_refused_naming_it_and_the_key(saved_moe, ws, tmp_path, case):
    """Every technique's entry of the meta is checked against the run (type, shape vs MoE layers × experts,
    range): a lie is one line naming the checkpoint and the key, before any step, and no checkpoint carries
    it on."""
    edit, mentions = LYING_META[case]
    with pytest.raises(UpcyclerError) as err:
        resumed_from(saved_moe, ws, tmp_path, 1, edit)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{tmp_path / 'run' / '1'}: "), line
    assert mentions in line and "resume from an earlier step" in line, line
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["1"]
    assert len(F.metrics(tmp_path / "run")) == 2  # nothing of a step ran


def test_rewinds_a_checkpoint_saved_are_carried_on_exactly(saved_moe, ws, tmp_path):
    """A well-formed record of rewinds (before the checkpoint's step) is taken back and written, as it was,
    into the next checkpoint's lineage."""
    rewinds = [{"step": 1, "averaged": [0]}]
    result = resumed_from(saved_moe, ws, tmp_path, 2, _set("rewinds", rewinds))
    assert result.step == 3
    lineage = read_checkpoint(tmp_path / "run" / "3").lineage
    assert [s["rewinds"] for s in lineage if "rewinds" in s] == [rewinds]


def test_a_run_starts_from_the_average_of_another_runs_last_checkpoints(ws, cache, tmp_path):
    run(ws, tmp_path / "a", steps=6, **{"checkpoint.every": 2, "checkpoint.keep": 3})
    steps = [F.step_params(tmp_path / "a" / "run" / str(n)) for n in (2, 4, 6)]
    cfg = F.config_dict(tmp_path / "b", ws["dense"], ws["data"], steps=1, **{
        "model.init_from_merge": {"sources": [str(tmp_path / "a" / "run")], "last": 3, "method": "sma"},
        "optimizer.lr": 0.0})
    train(TrainConfig.from_dict(cfg))
    started = F.step_params(tmp_path / "b" / "run" / "1")  # lr 0: the state it started from
    for name, value in started.items():
        np.testing.assert_allclose(value, sum(s[name] for s in steps) / 3, rtol=1e-6, atol=1e-7, err_msg=name)
    merge = [s for s in read_checkpoint(tmp_path / "b" / "run" / "1").lineage if s["step"] == "merge"]
    assert merge and [i["step"] for i in merge[-1]["inputs"]] == [2, 4, 6] and merge[-1]["method"] == "sma"
    train(TrainConfig.from_dict({**cfg, "steps": 2}), resume=True)  # a resumed run keeps where it started
    resumed = read_checkpoint(tmp_path / "b" / "run" / "2").lineage
    assert [s for s in resumed if s["step"] == "merge"] == merge

    bad = {**cfg, "run_dir": str(tmp_path / "c"), "model": {**cfg["model"], "init_from_merge": {"sources": [],
                                                                                                 "last": 3}}}
    proc = F.run_cli("continued-pretrain", "--config", F.write_config(tmp_path / "c.yaml", bad), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "model.init_from_merge" in proc.stderr and "name a run directory" in proc.stderr, proc.stderr
    inside = {**cfg, "run_dir": str(tmp_path / "a")}  # holds the steps it averages
    proc = F.run_cli("continued-pretrain", "--config", F.write_config(tmp_path / "d.yaml", inside), check=False)
    assert proc.returncode != 0 and "model.init_from_merge" in proc.stderr, proc.stderr


# --- EMA ---------------------------------------------------------------------------------------------------
def test_in_training_ema_equals_merge_ema_over_the_saved_steps(ws, cache, tmp_path):
    run(ws, tmp_path, "moe", steps=6, **{"optimizer.ema": 0.8, "checkpoint.every": 1, "checkpoint.keep": 10})
    run_dir = tmp_path / "run"
    F.run_cli("merge", run_dir, tmp_path / "merged", "--method", "ema", "--alpha", "0.2", "--to", "orbax")
    merged = F.step_params(tmp_path / "merged")
    ema = {k: np.asarray(t.load()) for k, t in read_checkpoint(run_dir / "6", "ema").tensors.items()}
    params = F.step_params(run_dir / "6")
    assert any(not np.array_equal(ema[n], params[n]) for n in params), "the EMA is just the weights"
    for name in merged:
        np.testing.assert_allclose(ema[name], merged[name], rtol=2e-6, atol=2e-7, err_msg=name)
    first = read_checkpoint(run_dir / "1", "ema")  # ema_1 = θ_1 exactly
    one = F.step_params(run_dir / "1")
    assert all(np.asarray(t.load()).tobytes() == one[k].tobytes() for k, t in first.tensors.items())
    F.run_cli("convert", run_dir / "6", tmp_path / "ema-hf", "--weights", "ema")
    exported = F.step_params(tmp_path / "ema-hf")
    assert all(exported[n].tobytes() == ema[n].tobytes() for n in ema)
    proc = F.run_cli("convert", tmp_path / "ema-hf", tmp_path / "x", "--weights", "ema", check=False)
    assert proc.returncode != 0 and "holds one set of weights" in proc.stderr and not (tmp_path / "x").exists()


def test_turning_ema_on_at_a_resume_is_refused(ws, cache, tmp_path):
    run(ws, tmp_path, steps=2, **{"checkpoint.every": 2})
    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=3, **{"optimizer.ema": 0.9})
    with pytest.raises(UpcyclerError, match="was saved without optimizer.ema"):
        train(TrainConfig.from_dict(cfg), resume=True)
    assert F.metrics(tmp_path / "run")[-1]["step"] == 1  # nothing trained, nothing saved
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["2"]


# --- Hugging Face export in the loop ------------------------------------------------------------------------
def test_hf_exports_in_the_loop_match_the_jax_model_of_their_step(ws, cache, tmp_path):
    run(ws, tmp_path, "moe", steps=4, **{"checkpoint.every": 2, "checkpoint.hf_every": 2,
                                          "checkpoint.hf_dtype": "float32"})
    ids = np.random.default_rng(0).integers(0, F.VOCAB, (2, 24))
    for step in (2, 4):
        step_dir = tmp_path / "run" / str(step)
        ckpt = read_checkpoint(step_dir)
        params = from_tensors(ckpt.spec, ckpt.tensors, dtype=np.float32)
        ours, _ = forward_jit(params, jnp.asarray(ids), ckpt.spec, ModelConfig())
        theirs = hf_logits(step_dir / "hf", ids)
        assert np.abs(np.asarray(ours) - theirs).max() < 1e-4, step
        assert read_checkpoint(step_dir / "hf").lineage[-2]["step"] == "convert"  # then this read


SLOW_EXPORT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import upcycler.io.hf_write as hf_write
    original = hf_write._write_shards
    def slow(tmp, *args, **kwargs):
        out = original(tmp, *args, **kwargs)
        print("written", flush=True)
        time.sleep(600)
        return out
    hf_write._write_shards = slow
    from upcycler.train.loop.checkpointing import export_hf
    export_hf(Path(sys.argv[1]), "bfloat16")
""")


def test_an_export_killed_midway_leaves_nothing_finished_and_the_resume_rewrites_it(ws, cache, tmp_path):
    run(ws, tmp_path, "moe", steps=2, **{"checkpoint.every": 2})
    step_dir = tmp_path / "run" / "2"
    assert not (step_dir / "hf").exists()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_EXPORT, str(step_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"  # every shard on disk, not yet renamed into place
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = sorted(p.name for p in step_dir.iterdir() if "hf" in p.name and p.name != ".hf.lock")
    assert left and all(name.startswith(".hf.partial-") for name in left), left  # and the killed writer's lock,
    # whose flock died with it: the resume takes it over
    with pytest.raises(UpcyclerError):
        read_checkpoint(step_dir / left[0])  # not a finished checkpoint: no manifest
    time.sleep(0.1)
    cfg = F.config_dict(tmp_path, ws["moe"], ws["data"], steps=3, **{"checkpoint.every": 2, "checkpoint.hf_every": 2})
    train(TrainConfig.from_dict(cfg), resume=True)
    assert [p.name for p in step_dir.iterdir() if "hf" in p.name] == ["hf"]
    exported = F.step_params(step_dir / "hf")
    params = F.step_params(step_dir)
    assert all(exported[n].tobytes() == params[n].astype(exported[n].dtype).tobytes() for n in params)
