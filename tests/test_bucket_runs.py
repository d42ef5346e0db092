"""Training with everything in a bucket (the run's loopback emulator): inputs, run_dir, metrics.

The tiny dense model is uploaded once and the test sources are prepared in the bucket by `upcycle
prepare-data` (gs:// globs in, a gs:// --out: the same token files as locally); every run reads
`model.init` and `data.dir` from gs:// and writes its run_dir there. Checked against runs on a local disk:

- one process: the bucket run is bit-identical to the local run (parameters and every logged metric),
  its last step exported to `STEP/hf/` during the run (`checkpoint.hf_every`) and by `upcycle convert`
  bucket to bucket holds the same weights, and `upcycle report` plots it;
  its metrics are objects, one per checkpoint interval, that concatenate to the local log's records
  (and survive Orbax's clean-up of the run_dir on a restart);
  no local `gs:` directory appears;
- a run whose newest step was left uncommitted (as by a kill during that save: the step's objects are
  there, Orbax's commit file is not) restarts with the same command from the step before, and ends
  bit-identical to the uninterrupted run;
- a simulated pod, 4 processes × 2 CPU devices, each with its own working directory, HOME, temporary
  and cache directories, sharing only the bucket: it matches the one-process run up to fp32 reduction
  order; SIGTERM to one process makes every process save the same step and exit with status 75, and the
  same commands restarted end bit-identical to the uninterrupted pod run; SIGKILL to one process takes the
  others down within the heartbeat timeout, and the restart ends bit-identical too;
- elastic resume: a run started on the pod continues on 2 processes × 2 devices (another process count,
  device count and mesh) with the same global batches as the uninterrupted pod run;
- a bucket that refuses writes for good in the middle of a run (its first checkpoint, or the metrics
  object written after it; through `faulty_storage`) ends the run within the retry policy, in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import gcs_emulator
import numpy as np
import pytest
import trainer_fixtures as F
from cli_helpers import assert_clean_failure
from faulty_storage import FaultyStorage
from xla_flags import with_devices

from upcycler.locations import location
from upcycler.train.config import TrainConfig
from upcycler.train.loop.trainer import train
from upcycler.train.reporting.metrics import TIMING_FIELDS, read_metrics
from upcycler.train.reporting.writers import local_mirror

pytestmark = pytest.mark.skipif(not gcs_emulator.is_running(), reason="the run's storage emulator is not set")
STEPS = 6
LR_BOUND = 2 * 3e-3 * STEPS  # twice the learning rates summed (at most the peak, 3e-3, per step)
TIMING = TIMING_FIELDS
POD = (4, {"data": 2, "fsdp": 4, "expert": 1})  # processes × 2 devices each, and the mesh over them
SMALL_POD = (2, {"data": 2, "fsdp": 2, "expert": 1})  # what an elastic resume continues on


def bucket_fs():
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem(token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"], skip_instance_cache=True,
                         use_listings_cache=False)


def key(url: str) -> str:
    return url.split("://", 1)[1]


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def bucket_metrics(run_dir: str) -> list[dict]:
    """The metrics objects of a bucket run_dir, read with gcsfs directly, in name order."""
    fs = bucket_fs()
    names = sorted(fs.glob(key(run_dir) + "/metrics-*.jsonl"))
    return [json.loads(line) for name in names for line in fs.cat_file(name).decode().splitlines()]


def bucket_step_params(run_dir: str, step: int, into: Path) -> dict[str, np.ndarray]:
    """A step of a bucket run_dir, downloaded with gcsfs and read with the public checkpoint reader."""
    local = into / "downloaded" / str(step)
    bucket_fs().get(key(run_dir) + f"/{step}/", str(local), recursive=True)
    return F.step_params(local)


def assert_identical(run_dir: str, reference_records, reference_params, tmp: Path) -> None:
    assert without_timing(bucket_metrics(run_dir)) == without_timing(reference_records)
    params = bucket_step_params(run_dir, STEPS, tmp)
    assert all(np.array_equal(reference_params[k], params[k]) for k in reference_params)


@pytest.fixture(scope="module")
def inputs(ws):
    """The tiny dense model copied to the bucket, and the test sources' text files too, prepared there by
    `upcycle prepare-data` from gs:// globs into a gs:// --out: its token files must be the local ones."""
    root = gcs_emulator.unique_prefix("inputs")
    fs = bucket_fs()
    fs.put(str(ws["dense"]) + "/", key(root) + "/dense/", recursive=True)
    for name, files in F.SOURCES.items():
        for file in files:
            fs.put_file(str(file), key(root) + f"/text/{name}/{file.name}")
    sources = [item for name in F.SOURCES for item in ("--source", f"{name}={root}/text/{name}/*.py")]
    F.run_cli("prepare-data", "--tokenizer", ws["tokenizer"], *sources, "--out", f"{root}/data", "--format", "text",
              timeout=600)
    for name in F.SOURCES:
        index = json.loads(fs.cat_file(key(root) + f"/data/{name}.index.json"))
        assert index["shards"] == json.loads((ws["data"] / f"{name}.index.json").read_text())["shards"]
        for shard in index["shards"]:
            assert fs.cat_file(key(root) + f"/data/{shard['file']}") == (ws["data"] / shard["file"]).read_bytes()
        assert [f["path"] for f in index["files"]] == [f"{root}/text/{name}/{p.name}" for p in F.SOURCES[name]]
    again = F.run_cli("prepare-data", "--tokenizer", ws["tokenizer"], *sources, "--out", f"{root}/data",
                      "--format", "text", check=False, timeout=600)
    assert again.returncode == 2 and "email.index.json': already exists" in again.stderr
    return {"init": f"{root}/dense", "data": f"{root}/data"}


def bucket_config(folder: Path, run_dir: str, inputs, ws, **changes) -> Path:
    """A config in `folder` (created) that reads the inputs from the bucket and trains into `run_dir`."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = F.config_dict(folder, ws["dense"], ws["data"], **{"steps": STEPS, **changes})
    cfg["run_dir"], cfg["model"]["init"], cfg["data"]["dir"] = run_dir, inputs["init"], inputs["data"]
    return F.write_config(folder / "train.yaml", cfg)


@pytest.fixture(scope="module")
def local_run(ws, tmp_path_factory):
    """The same run on a local disk, in this process: its metrics and final parameters."""
    root = tmp_path_factory.mktemp("local")
    train(TrainConfig.from_dict(F.config_dict(root, ws["dense"], ws["data"], steps=STEPS)))
    return F.metrics(root / "run"), F.step_params(root / "run" / str(STEPS))


def test_a_bucket_run_is_the_local_run(ws, inputs, local_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = gcs_emulator.unique_prefix("run")
    out = F.run_cli("continued-pretrain", "--config", bucket_config(tmp_path / "cfg", run_dir, inputs, ws),
                    "--set", f"checkpoint.hf_every={STEPS}", timeout=600).stdout
    assert f"finished at step {STEPS}; last checkpoint: {run_dir}/{STEPS}" in out
    assert_identical(run_dir, *local_run, tmp_path)
    assert without_timing(read_metrics(location(run_dir, "run_dir"))) == without_timing(local_run[0])
    objects = sorted(bucket_fs().glob(key(run_dir) + "/metrics-*.jsonl"))
    assert [Path(o).name for o in objects] == ["metrics-0000000000-0000000001.jsonl",
                                               "metrics-0000000002-0000000003.jsonl",
                                               "metrics-0000000004-0000000005.jsonl"]
    config = bucket_fs().cat_file(key(run_dir) + "/config.yaml").decode()
    assert f"init: {inputs['init']}" in config and f"dir: {inputs['data']}" in config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg", "downloaded"]  # no local gs: directory
    # the TensorBoard event files were uploaded beside them and hold the run's losses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bucket_fs().get(key(run_dir) + "/tensorboard/", str(tmp_path / "tb"), recursive=True)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in local_run[0]]
    refused = F.run_cli("report", run_dir, check=False, timeout=300)
    assert refused.returncode == 2 and "a run_dir in a bucket needs --out" in refused.stderr
    pngs = F.run_cli("report", run_dir, "--out", tmp_path / "report", timeout=300).stdout.split()
    assert "loss.png" in [Path(p).name for p in pngs] and all(Path(p).is_file() for p in pngs)
    F.run_cli("convert", f"{run_dir}/{STEPS}", f"{run_dir}-hf", timeout=600)  # a step exported bucket to bucket
    bucket_fs().get(key(run_dir) + "-hf/", str(tmp_path / "hf"), recursive=True)
    exported, trained = F.step_params(tmp_path / "hf"), local_run[1]
    assert exported.keys() == trained.keys() and all(np.array_equal(exported[k], trained[k]) for k in trained)
    in_run = sorted(Path(k).name for k in bucket_fs().find(key(run_dir) + f"/{STEPS}/hf/"))  # checkpoint.hf_every
    assert in_run == ["config.json", "model.safetensors", "tokenizer.json", "upcycler.json"], in_run
    bucket_fs().get(key(run_dir) + f"/{STEPS}/hf/", str(tmp_path / "hf-in-run"), recursive=True)
    exported = F.step_params(tmp_path / "hf-in-run")  # bf16, the default checkpoint.hf_dtype
    assert all(np.array_equal(exported[k], trained[k].astype(exported[k].dtype)) for k in trained)


def test_an_uncommitted_step_in_a_bucket_is_redone_on_restart(ws, inputs, local_run, tmp_path):
    """Stopped at step 4, then step 4's commit file removed (a kill during its save leaves the step's
    other objects): the same command resumes from step 2 and ends as the uninterrupted run."""
    run_dir = gcs_emulator.unique_prefix("restart")
    path = bucket_config(tmp_path / "cfg", run_dir, inputs, ws)
    F.run_cli("continued-pretrain", "--config", path, "--steps", "4", timeout=600)
    bucket_fs().rm_file(key(run_dir) + "/4/commit_success.txt")
    shutil.rmtree(local_mirror(location(run_dir, "run_dir")))  # the restart runs on another host
    out = F.run_cli("continued-pretrain", "--config", path, timeout=600).stdout
    assert f"finished at step {STEPS}" in out
    assert_identical(run_dir, *local_run, tmp_path)
    # Orbax removes a bucket run_dir's unmarked directories when a run starts: TensorBoard's survived,
    # with the event files of both attempts
    events = bucket_fs().glob(key(run_dir) + "/tensorboard/events.out.tfevents.*")
    assert len(events) == 2, events


def start_host(host: Path, config: Path, process: int, processes: int, port: int) -> subprocess.Popen:
    """`continued-pretrain` as process `process` of `processes`, on a simulated host of its own (2 CPU
    devices; its own working directory, HOME, temporary and cache directories)."""
    (host / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XLA_FLAGS": with_devices(2, fast_compile=True), "HOME": str(host),
           "TMPDIR": str(host / "tmp"), "UPCYCLER_CACHE": str(host / "cache")}
    command = [sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(config), "--coordinator",
               f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(process)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=host)


def run_pod(tmp: Path, run_dir: str, inputs, ws, *, pod=POD, sigterm_after: int | None = None, kill: bool = False,
            **changes) -> list[tuple[int, str]]:
    """Every host of the pod (`pod`: processes and mesh; each host with its own copy of the config); with
    `sigterm_after`, SIGTERM (SIGKILL with `kill`) to process 1 once step `sigterm_after` is committed.
    Returns each process's exit status and last line."""
    port, (processes, mesh) = F.free_port(), pod
    procs = [start_host(tmp / f"host{i}", bucket_config(tmp / f"host{i}", run_dir, inputs, ws, mesh=mesh, **changes),
                        i, processes, port) for i in range(processes)]
    if sigterm_after is not None:
        deadline = time.monotonic() + 600
        while not bucket_fs().exists(key(run_dir) + f"/{sigterm_after}/commit_success.txt"):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    ends = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert kill or proc.returncode in (0, 75), err[-3000:]
        ends.append((proc.returncode, (out.strip().splitlines() or [""])[-1]))
    return ends


@pytest.fixture(scope="module")
def pod_run(ws, inputs, tmp_path_factory):
    run_dir = gcs_emulator.unique_prefix("pod")
    tmp = tmp_path_factory.mktemp("pod")
    assert [status for status, _ in run_pod(tmp, run_dir, inputs, ws)] == [0] * POD[0]
    return bucket_metrics(run_dir), bucket_step_params(run_dir, STEPS, tmp)


def test_a_pod_sharing_only_the_bucket_matches_one_process(pod_run, local_run):
    (pod_metrics, pod_params), (metrics, params) = pod_run, local_run
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[name] for r in pod_metrics], [r[name] for r in metrics], rtol=2e-5)
    F.assert_same_training(pod_params, params, lr_bound=LR_BOUND)


def test_sigterm_on_a_pod_host_saves_one_step_and_the_restart_ends_as_uninterrupted(ws, inputs, pod_run,
                                                                                    tmp_path):
    run_dir = gcs_emulator.unique_prefix("preempted")
    first = run_pod(tmp_path, run_dir, inputs, ws, sigterm_after=2)
    assert [status for status, _ in first] == [75] * POD[0] and len({line for _, line in first}) == 1, first
    assert first[0][1].startswith("stopped by SIGTERM at step ")
    again = run_pod(tmp_path, run_dir, inputs, ws)
    assert [status for status, _ in again] == [0] * POD[0], again
    assert_identical(run_dir, *pod_run, tmp_path)


def test_a_run_resumed_on_another_topology_continues_the_same_batches(ws, inputs, pod_run, tmp_path):
    """Elastic resume: 4 steps on the pod (4 processes × 2 devices, mesh data=2 × fsdp=4), then the same
    run_dir resumed by 2 processes × 2 devices (data=2 × fsdp=2): parameters and optimiser state restored
    with the new shardings, and every later step sees the global batch of the uninterrupted pod run (the
    same token count and per-source losses within fp32 reduction order)."""
    run_dir = gcs_emulator.unique_prefix("elastic")
    assert [status for status, _ in run_pod(tmp_path / "big", run_dir, inputs, ws, steps=4)] == [0] * POD[0]
    assert [status for status, _ in run_pod(tmp_path / "small", run_dir, inputs, ws, pod=SMALL_POD)] == [0, 0]
    metrics, reference = bucket_metrics(run_dir), pod_run[0]
    assert [r["step"] for r in metrics] == list(range(STEPS))
    assert without_timing(metrics[:4]) == without_timing(reference[:4])  # the big pod's steps, as they were
    for name in ("loss", "loss/json", "loss/email", "grad_norm", "tokens"):
        np.testing.assert_allclose([r[name] for r in metrics[4:]], [r[name] for r in reference[4:]], rtol=2e-5,
                                   err_msg=name)
    params = bucket_step_params(run_dir, STEPS, tmp_path)
    F.assert_same_training(params, pod_run[1], lr_bound=LR_BOUND)


def test_a_pod_host_killed_takes_the_job_down_and_the_restart_resumes(ws, inputs, pod_run, tmp_path):
    """SIGKILL to process 1 (no chance to save): process 0 stops once the lost heartbeat is noticed
    (`distributed.heartbeat_timeout` 5 s here, instead of waiting in a collective for ever); the same
    commands restarted resume from the last committed checkpoint and end bit-identical to the
    uninterrupted pod run."""
    run_dir = gcs_emulator.unique_prefix("killed")
    started = time.monotonic()
    first = run_pod(tmp_path, run_dir, inputs, ws, sigterm_after=2, kill=True,
                    **{"distributed.heartbeat_timeout": 5})
    assert first[1][0] == -signal.SIGKILL and all(status not in (0, 75) for status, _ in first), first
    assert time.monotonic() - started < 300
    again = run_pod(tmp_path, run_dir, inputs, ws, **{"distributed.heartbeat_timeout": 5})
    assert [status for status, _ in again] == [0] * POD[0], again
    assert_identical(run_dir, *pod_run, tmp_path)


@pytest.mark.parametrize(("key", "deadline"), [("run_dir", None), ("data.dir", 2)])
def test_an_unreachable_bucket_in_a_config_fails_before_jax_starts(ws, key, deadline, tmp_path, monkeypatch):
    """Connections refused: the config's bucket is probed before anything else reads it and before JAX
    starts (no device line, no traceback), within the retry deadline (the default's, or one set by
    UPCYCLER_GCS_DEADLINE), naming the key; nothing is made."""
    from upcycler.bucket_client import RetryPolicy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed: refused
    cfg = F.config_dict(tmp_path / "local", ws["dense"], ws["data"], steps=2,
                        **{key: gcs_emulator.unique_prefix("unreachable")})
    path = F.write_config(tmp_path / "train.yaml", cfg)
    monkeypatch.chdir(tmp_path)
    env = {"STORAGE_EMULATOR_HOST": endpoint, "UPCYCLER_CACHE": str(tmp_path / "cache")}
    if deadline is not None:
        env["UPCYCLER_GCS_DEADLINE"] = str(deadline)
    started = time.monotonic()
    proc = F.run_cli("continued-pretrain", "--config", path, check=False, timeout=120, env=env)
    seconds = time.monotonic() - started
    line = assert_clean_failure(proc, mentions=f"{key}: 'gs://")
    assert f"Cloud Storage at {endpoint} does not answer (connection refused" in line
    assert seconds < (deadline or RetryPolicy.deadline) + 10, seconds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.yaml"]


def test_a_run_dir_in_a_missing_bucket_is_refused_before_jax_starts(ws, tmp_path, monkeypatch):
    cfg = F.config_dict(tmp_path / "local", ws["dense"], ws["data"], steps=2, run_dir="gs://upcycler-no-such-bucket/run")
    path = F.write_config(tmp_path / "train.yaml", cfg)
    monkeypatch.chdir(tmp_path)
    proc = F.run_cli("continued-pretrain", "--config", path, check=False, timeout=120)
    assert_clean_failure(proc, mentions="run_dir: 'gs://upcycler-no-such-bucket/run': no such bucket")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.yaml"]


def test_bucket_data_is_read_in_place_and_checked(ws, inputs):
    """The sources prepared into the bucket are read where they are (ranged reads, no copy in the cache):
    the batches equal those of the same sources on a local disk; a shard swapped in the bucket after
    preparation is refused by name before any batch."""
    from upcycler.errors import UpcyclerError
    from upcycler.io.remote_sources import cache_root
    from upcycler.train.data.config import DataConfig, Phase
    from upcycler.train.data.mix import make_data_iterator
    from upcycler.train.data.sources import open_source

    def batches(directory) -> list[dict]:
        config = DataConfig(dir=directory, seq_len=32, global_batch_size=8, seed=1,
                            phases=(Phase({"json": 0.5, "email": 0.5}),))
        iterator = make_data_iterator(config, 1, 2)
        return [next(iterator) for _ in range(5)]

    cached = sorted(cache_root().rglob("*.tokens")) if cache_root().exists() else []
    remote, local = batches(location(inputs["data"], "data.dir")), batches(ws["data"])
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(remote, local) for k in a)
    assert (sorted(cache_root().rglob("*.tokens")) if cache_root().exists() else []) == cached
    fs = bucket_fs()
    damaged = gcs_emulator.unique_prefix("damaged")
    for name in ("json", "email"):
        fs.put_file(str(ws["data"] / f"{name}.index.json"), key(damaged) + f"/{name}.index.json")
    shard = json.loads((ws["data"] / "json.index.json").read_text())["shards"][0]["file"]
    other = json.loads((ws["data"] / "email.index.json").read_text())["shards"][0]["file"]
    fs.put_file(str(ws["data"] / other), key(damaged) + f"/{shard}")
    with pytest.raises(UpcyclerError, match=r"json\.shards/00000\.tokens.*does not match json\.index\.json"):
        open_source(damaged, "json")


def without_credentials_notice(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`proc` without the line tensorstore logs when it finds no Google credentials (the emulator needs
    none; on Cloud Storage there are some): not ours, and not about the failure."""
    kept = [line for line in proc.stderr.splitlines(keepends=True) if "google_auth_provider.cc" not in line]
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, "".join(kept))


@pytest.mark.parametrize(("refused", "says"), [("/2", "writing a checkpoint failed"),
                                               ("/metrics-", "writing the metrics of steps 0-1 failed")])
def test_a_bucket_that_refuses_writes_mid_run_ends_it_in_one_line(ws, refused, says, tmp_path, monkeypatch):
    """From the first checkpoint on (step 2), the bucket answers 503 to every write of that step, or of the
    metrics object written once it is saved: tensorstore and gcsfs give up within the retry policy (not
    tensorstore's default of about 15 minutes), and the run ends with one line naming the run_dir and
    what to do, without a traceback."""
    run_dir = gcs_emulator.unique_prefix("refused")
    proxy = FaultyStorage(os.environ["STORAGE_EMULATOR_HOST"])
    try:
        fault = proxy.refuse_writes(key(run_dir) + refused)
        cfg = F.config_dict(tmp_path / "local", ws["dense"], ws["data"], steps=4, run_dir=run_dir)
        path = F.write_config(tmp_path / "train.yaml", cfg)
        monkeypatch.chdir(tmp_path)
        env = {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url,
               "UPCYCLER_CACHE": str(tmp_path / "cache")}
        started = time.monotonic()
        proc = F.run_cli("continued-pretrain", "--config", path, check=False, timeout=600, env=env)
        seconds = time.monotonic() - started
    finally:
        proxy.stop()
    line = assert_clean_failure(without_credentials_notice(proc), mentions=f"error: {run_dir}: {says}")
    assert "then run the same command again" in line and fault.damaged > 0
    assert seconds < 180, seconds
