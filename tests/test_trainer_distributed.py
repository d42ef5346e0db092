"""The same run on 1 device, on 8 fake devices (FSDP × expert parallel, pure FSDP) and on 2 processes.

Each sharded run is a subprocess, since the fake device count must be set before JAX starts; the
single-device reference runs in this process meanwhile. A tiny MoE (4 experts, top-2) or dense model
trains 3 steps; losses and parameters must agree with the single-device run up to fp32 reduction order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trainer_fixtures as F
from xla_flags import CLASSIC_EMITTERS, with_devices

from upcycler.train.config import TrainConfig
from upcycler.train.loop.preflight import committed_steps
from upcycler.train.loop.trainer import train
from upcycler.train.reporting.metrics import TIMING_FIELDS

STEPS = 3


def one_device_run(ws, model: str, root, **changes) -> tuple[list, dict]:
    """The single-device run of `model` ("dense" or "moe"): its metrics and final parameters."""
    train(TrainConfig.from_dict(F.config_dict(root, ws[model], ws["data"], steps=STEPS, **changes)))
    return F.metrics(root / "run"), F.step_params(root / "run" / str(STEPS))


def start(path, *args: str, devices: int, host: Path | None = None):
    """The CLI in a child process that sees `devices` CPU devices; with `host`, a simulated host of its own
    (working directory, HOME and temporary directory in `host`)."""
    # compiled fast only where that keeps results within rounding of the in-process run (xla_flags)
    env = {**os.environ, "XLA_FLAGS": with_devices(devices, fast_compile=CLASSIC_EMITTERS)}
    if host is not None:
        (host / "tmp").mkdir(parents=True, exist_ok=True)
        env.update(HOME=str(host), TMPDIR=str(host / "tmp"), UPCYCLER_CACHE=str(host / "cache"))
    command = [sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(path), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=host)


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
    """An MoE on meshes fsdp=4 × expert=2 and fsdp=8 (both runs side by side) against one device without
    rematerialisation; the sharded runs keep only named activations (`model.remat`), on the device through
    the expert-parallel dispatch and offloaded to host memory."""
    meshes = {"fsdp4xexpert2": ({"fsdp": 4, "expert": 2}, "attention_and_ffn_input"),
              "fsdp8": ({"fsdp": 8, "expert": 1}, "offload_attention")}
    procs = []
    for name, (mesh, remat) in meshes.items():
        cfg = F.config_dict(tmp_path / name, ws["moe"], ws["data"], steps=STEPS, mesh={"data": 1, **mesh},
                            **{"model.remat": remat})
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


@pytest.mark.parametrize("mesh", [{"data": 2, "fsdp": 2, "expert": 1}, {"data": 1, "fsdp": 1, "context": 4}],
                         ids=["data2xfsdp2", "context4-across-processes"])
def test_two_processes_match_one(ws, cache, tmp_path, mesh):
    """A dense model on 2 processes × 2 devices against one device: data=2 × fsdp=2, and context=4, each
    sequence split over the devices of both processes (both read the same rows, each device its chunks)."""
    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=STEPS, mesh=mesh)
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


def two_process_args(port: int, i: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]


def test_a_run_dir_the_processes_do_not_share_is_refused(ws, cache, tmp_path):
    """Two simulated hosts, each with run_dir on its own disk: both stop before any step, with one line
    naming the process that cannot see process 0's run_dir, and nothing but config.yaml is written."""
    port, procs = F.free_port(), []
    for i in range(2):
        host = tmp_path / f"host{i}"
        host.mkdir()
        cfg = F.config_dict(host, ws["dense"], ws["data"], steps=STEPS, mesh={"data": 2, "fsdp": 2, "expert": 1})
        procs.append(start(F.write_config(host / "train.yaml", cfg), *two_process_args(port, i), devices=2,
                           host=host))
    for i, proc in enumerate(procs):
        _, err = proc.communicate(timeout=600)
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert lines[0] == (f"error: {tmp_path / f'host{i}' / 'run'}: run_dir is not shared by the run's 2 "
                            "processes: process 1 cannot see what process 0 wrote there (each host's own disk?); "
                            "put run_dir on a filesystem every host mounts at the same path")
        assert sorted(p.name for p in (tmp_path / f"host{i}" / "run").iterdir()) == ["config.yaml"][:1 - i]


def test_sigterm_on_one_process_stops_every_process_at_the_same_step(ws, cache, tmp_path):
    """SIGTERM to process 1 only: both processes save the same step and exit with status 75."""
    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=100_000, mesh={"data": 2, "fsdp": 2, "expert": 1},
                        **{"checkpoint.every": 100_000})
    path, port = F.write_config(tmp_path / "train.yaml", cfg), F.free_port()
    procs = [start(path, *two_process_args(port, i), devices=2) for i in range(2)]
    from test_trainer_resume import wait_for_step

    wait_for_step(procs[0], tmp_path / "run", 2, checkpoint=False)
    procs[1].send_signal(signal.SIGTERM)
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 75, err[-3000:]
        outs.append(out.strip().splitlines()[-1])
    logged = len(F.metrics(tmp_path / "run"))
    assert outs[0] == outs[1] and outs[0].startswith(f"stopped by SIGTERM at step {logged};"), outs
    assert list(committed_steps(tmp_path / "run")) == [logged]


EP_STEPS = 50
EP_MESH = {"data": 1, "fsdp": 2, "expert": 4}  # the tiny MoE's 4 experts: one per device of the expert axis
EP_RUNS = {  # name: (moe_dispatch, comm_dtype, relative tolerance on every step's loss against gspmd)
    "all_to_all": ("all_to_all", "fp32", 1e-4),
    "all_gather": ("all_gather", "fp32", 1e-4),
    "all_gather_chunks": ("all_gather", "fp32", 1e-4),  # model.moe_chunks 4
    "all_to_all_bf16": ("all_to_all", "bf16", 5e-3),
    "all_gather_bf16": ("all_gather", "bf16", 5e-3),
}


def ep_config(tmp_path, ws, name: str, dispatch: str, comm_dtype: str, steps: int = EP_STEPS, **changes):
    cfg = F.config_dict(tmp_path / name, ws["moe"], ws["data"], steps=steps, mesh=EP_MESH,
                        **{"model.moe_dispatch": dispatch, "model.comm_dtype": comm_dtype,
                           "checkpoint.every": 10, "metrics.expert_load_every": 1, **changes})
    return F.write_config(tmp_path / f"{name}.yaml", cfg)


def test_expert_parallel_runs_match_the_gspmd_run(ws, cache, tmp_path):
    """50 steps with expert=4: each dispatch variant against the GSPMD run on the same mesh. Uncompressed,
    the first step's load-balancing loss and expert load are identical (same parameters, routing computed
    the same way; with a bf16 combine the second MoE layer's inputs differ); every step's loss agrees
    within 1e-4 relative, or 0.5% with a bf16 combine."""
    runs = {"gspmd": ("gspmd", "fp32", 0.0), **EP_RUNS}
    procs = [start(ep_config(tmp_path, ws, name, d, c, **{"model.moe_chunks": 4 if "chunks" in name else 1}),
                   devices=8) for name, (d, c, _) in runs.items()]
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        assert proc.returncode == 0, err[-3000:]
    reference = F.metrics(tmp_path / "gspmd" / "run")
    assert len(reference) == EP_STEPS
    for name, (_, _, rtol) in EP_RUNS.items():
        metrics = F.metrics(tmp_path / name / "run")
        if rtol <= 1e-4:
            assert metrics[0]["lb_loss"] == reference[0]["lb_loss"], name
            assert metrics[0]["expert_load"] == reference[0]["expert_load"], name
        np.testing.assert_allclose([r["loss"] for r in metrics], [r["loss"] for r in reference], rtol=rtol,
                                   err_msg=name)
        if rtol > 1e-4:  # the compression is really applied: the losses are not bit-equal
            assert [r["loss"] for r in metrics] != [r["loss"] for r in reference], name


def test_expert_parallel_runs_killed_and_resumed_are_bit_identical(ws, cache, tmp_path):
    """Each variant (bf16 combine, 20 steps): killed after its step-10 checkpoint, resumed, against its own
    uninterrupted run: parameters and every logged metric bit-equal."""
    from test_trainer_resume import wait_for_step

    steps, variants = 20, {"all_to_all": "all_to_all", "all_gather": "all_gather"}
    straight = {n: start(ep_config(tmp_path, ws, f"{n}_straight", d, "bf16", steps), devices=8)
                for n, d in variants.items()}
    for name, dispatch in variants.items():
        path = ep_config(tmp_path, ws, name, dispatch, "bf16", steps)
        proc = start(path, devices=8)
        wait_for_step(proc, tmp_path / name / "run", 12)
        proc.kill()
        proc.communicate()
        resumed = start(path, "--resume", devices=8)
        out, err = resumed.communicate(timeout=1200)
        assert resumed.returncode == 0 and f"finished at step {steps}" in out, err[-3000:]
    for name in variants:
        out, err = straight[name].communicate(timeout=1200)
        assert straight[name].returncode == 0, err[-3000:]
        reference = F.step_params(tmp_path / f"{name}_straight" / "run" / str(steps))
        final = F.step_params(tmp_path / name / "run" / str(steps))
        assert all(np.array_equal(reference[k], final[k]) for k in reference), name
        strip = TIMING_FIELDS
        logs = [[{k: v for k, v in r.items() if k not in strip} for r in F.metrics(tmp_path / run / "run")]
                for run in (f"{name}_straight", name)]
        assert logs[0] == logs[1], name


def test_expert_parallel_on_two_processes_matches_one_process(ws, cache, tmp_path):
    """all_to_all over 2 processes × 4 devices (the expert axis spans both) against one process × 8."""
    steps = 6
    one = start(ep_config(tmp_path, ws, "one", "all_to_all", "fp32", steps), devices=8)
    path = ep_config(tmp_path, ws, "two", "all_to_all", "fp32", steps)
    port = F.free_port()
    procs = [start(path, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                   devices=4) for i in range(2)]
    for proc in (one, *procs):
        _, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, err[-3000:]
    reference, metrics = F.metrics(tmp_path / "one" / "run"), F.metrics(tmp_path / "two" / "run")
    for key in ("loss", "lb_loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in metrics], [r[key] for r in reference], rtol=2e-5, err_msg=key)


def test_context_parallel_run_resumed_at_another_context_degree_matches_the_uninterrupted_run(ws, cache, tmp_path):
    """An MoE on context 4 × FSDP 2, killed at a random step after a checkpoint and resumed on context 2 ×
    FSDP 4 (the checkpoint holds global arrays), against the uninterrupted context-4 run and one device:
    the same batches (losses within fp32 reduction order) and the same final parameters."""
    import random

    from test_trainer_resume import wait_for_step

    steps, every = 12, 3

    def config(name: str, context: int) -> Path:
        cfg = F.config_dict(tmp_path / name, ws["moe"], ws["data"], steps=steps, mesh={"data": 1, "context": context},
                            **{"checkpoint.every": every, "metrics.progress": context == 2})
        return F.write_config(tmp_path / f"{name}-{context}.yaml", cfg)

    straight = start(config("straight", 4), devices=8)
    killed = start(config("resumed", 4), devices=8)
    wait_for_step(killed, tmp_path / "resumed" / "run", random.randrange(every + 1, steps - 2))
    killed.kill()
    killed.communicate()
    interrupted_at = max(committed_steps(tmp_path / "resumed" / "run"))
    assert interrupted_at < steps
    resumed = start(config("resumed", 2), "--resume", devices=8)
    out, err = resumed.communicate(timeout=1200)
    assert resumed.returncode == 0 and f"finished at step {steps}" in out, err[-3000:]
    assert "fsdp=4 × context=2" in out + err  # the resumed run really ran on the other degree
    out, err = straight.communicate(timeout=1200)
    assert straight.returncode == 0, err[-3000:]
    reference = F.step_params(tmp_path / "straight" / "run" / str(steps))
    final = F.step_params(tmp_path / "resumed" / "run" / str(steps))
    worst = max(float(np.abs(final[k] - reference[k]).max()) for k in reference)
    assert worst < 5e-5, (interrupted_at, worst)
    losses = [[r["loss"] for r in F.metrics(tmp_path / run / "run")] for run in ("straight", "resumed")]
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-5)
    one, _ = one_device_run(ws, "moe", tmp_path / "one")  # and their first steps equal one device's
    np.testing.assert_allclose(losses[0][:STEPS], [r["loss"] for r in one], rtol=2e-5)
