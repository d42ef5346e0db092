"""The same run on 1 device, on 8 fake devices (FSDP × expert parallel, pure FSDP) and on 2 processes.

Each sharded run is a subprocess, since the fake device count must be set before JAX starts; the
single-device reference runs in this process meanwhile. A tiny MoE (4 experts, top-2) or dense model
trains 3 steps; losses and parameters must agree with the single-device run up to fp32 reduction order.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import trainer_fixtures as F

from upcycler.train.config import TrainConfig
from upcycler.train.trainer import train

STEPS = 3


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return F.workspace(tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="module")
def cache(ws):
    yield from F.compile_cache(ws)


def one_device_run(ws, model: str, root, **changes) -> tuple[list, dict]:
    """The single-device run of `model` ("dense" or "moe"): its metrics and final parameters."""
    train(TrainConfig.from_dict(F.config_dict(root, ws[model], ws["data"], steps=STEPS, **changes)))
    return F.metrics(root / "run"), F.step_params(root / "run" / str(STEPS))


def start(path, *args: str, devices: int):
    """The CLI in a child process that sees `devices` CPU devices."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    command = [sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(path), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(procs) -> None:
    for proc in procs:
        out, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, err[-3000:]
        assert f"finished at step {STEPS}" in out


def assert_same_run(run_dir, reference, keys=("loss", "lb_loss", "z_loss", "grad_norm")) -> None:
    ref_metrics, ref_params = reference
    metrics = F.metrics(run_dir)
    for key in keys:
        if key in ref_metrics[0]:
            np.testing.assert_allclose(
                [r[key] for r in metrics], [r[key] for r in ref_metrics], rtol=2e-5, err_msg=key
            )
    assert [r.get("expert_load") for r in metrics] == [r.get("expert_load") for r in ref_metrics]
    params = F.step_params(run_dir / str(STEPS))
    worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
    assert worst < 5e-5, worst


def test_eight_devices_match_one(ws, cache, tmp_path):
    """An MoE on meshes fsdp=4 × expert=2 and fsdp=8 (both runs side by side) against one device."""
    meshes = {"fsdp4xexpert2": {"fsdp": 4, "expert": 2}, "fsdp8": {"fsdp": 8, "expert": 1}}
    procs = []
    for name, mesh in meshes.items():
        cfg = F.config_dict(tmp_path / name, ws["moe"], ws["data"], steps=STEPS, mesh={"data": 1, **mesh})
        procs.append(start(F.write_config(tmp_path / f"{name}.yaml", cfg), devices=8))
    reference = one_device_run(ws, "moe", tmp_path / "one")
    finish(procs)
    for name in meshes:
        assert_same_run(tmp_path / name / "run", reference)


def test_memory_options_on_four_devices_match_plain_one_device(ws, cache, tmp_path):
    """Microbatches (each device splitting its own rows), full remat, chunked cross-entropy and chunked
    attention on mesh fsdp=4, against the plain step on one device (the load-balancing loss off: it is a
    per-microbatch statistic)."""
    options = {"data.microbatches": 2, "model.remat": "full", "loss.ce_chunk": 8, "model.attention": "chunked",
               "model.attention_chunk": 8}
    cfg = F.config_dict(tmp_path / "options", ws["moe"], ws["data"], steps=STEPS, mesh={"data": 1, "fsdp": 4},
                        **{"loss.lb_coef": 0.0}, **options)
    procs = [start(F.write_config(tmp_path / "options.yaml", cfg), devices=4)]
    reference = one_device_run(ws, "moe", tmp_path / "one", **{"loss.lb_coef": 0.0})
    finish(procs)
    assert_same_run(tmp_path / "options" / "run", reference, keys=("loss", "z_loss", "grad_norm"))


def test_two_processes_match_one(ws, cache, tmp_path):
    """A dense model on 2 processes × 2 devices (mesh data=2 × fsdp=2) against one device."""
    cfg = F.config_dict(
        tmp_path, ws["dense"], ws["data"], steps=STEPS, mesh={"data": 2, "fsdp": 2, "expert": 1}
    )
    path = F.write_config(tmp_path / "train.yaml", cfg)
    port = F.free_port()
    procs = [
        start(
            path,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
            devices=2,
        )
        for i in range(2)
    ]
    reference = one_device_run(ws, "dense", tmp_path / "one")
    finish(procs)
    assert_same_run(tmp_path / "run", reference)
