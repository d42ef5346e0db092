"""Storage that misbehaves: the commands that read and write buckets, through a proxy in front of the run's
emulator that damages what passes (`faulty_storage`: seeded, loopback only).

- Transient faults change nothing: dense-to-moe from a user's own upload, a merge, prepare-data from gs://
  text into a gs:// --out and a training run reading and writing the bucket, each with about one request
  in twelve meeting a 503, a 429, a reset, a lost answer (the write done, the client told nothing), a
  delayed answer or a body cut short (and, for the run, the first read of a weight file, a config, an
  index and a token shard each arriving with a bit flipped), write exactly what the same commands write
  without the proxy.
- A flipped bit in every download of an object is never accepted: a model's config (mirrored, checked
  against the bucket's CRC32C), a prepared source's index (a whole-object read, checked the same way) and
  a token shard (checked by the CRC32C of each block in its index) are refused in one line naming the
  object, and once the damage is gone the same command, with the same cache, succeeds.
- A bucket that refuses every write for good ends a surgery and a preparation within the retry policy's
  deadline, in one line, with nothing at the output that reads as finished.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gcs_emulator
import numpy as np
import pytest
import trainer_fixtures as F
from cli_helpers import assert_clean_failure, run_cli
from faulty_storage import TRANSIENT_KINDS, FaultyStorage

from upcycler.io import object_store as store
from upcycler.io.bucket_output import WRITING
from upcycler.io.manifest import MANIFEST
from upcycler.train.reporting.metrics import TIMING_FIELDS

pytestmark = pytest.mark.skipif(not gcs_emulator.is_running(), reason="the run's storage emulator is not set")
RATE = 0.08  # the share of requests that meet a transient fault
STEPS = 4


def objects(url: str) -> dict[str, bytes]:
    """Every object under `url`, read with gcsfs straight from the emulator (not through the proxy or the
    code under test)."""
    from gcsfs.core import GCSFileSystem

    fs = GCSFileSystem(token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"], skip_instance_cache=True,
                       use_listings_cache=False)
    prefix = url.split("://", 1)[1] + "/"
    return {key[len(prefix):]: fs.cat_file(key) for key in fs.find(prefix)}


def assert_same_objects(url: str, expected_url: str) -> None:
    """The objects at `url` are those at `expected_url`, byte for byte; a manifest once the one URL is read
    as the other (it names its output)."""
    got, expected = objects(url), objects(expected_url)
    assert sorted(got) == sorted(expected), (url, sorted(got), sorted(expected))
    for name, data in expected.items():
        if name.endswith(MANIFEST):
            assert json.loads(got[name]) == json.loads(data.decode().replace(expected_url, url)), name
        else:
            assert got[name] == data, (url, name)


def cli_env(proxy: FaultyStorage, tmp: Path, **more: str) -> dict[str, str]:
    """The environment of a command whose every bucket request goes through `proxy`, with a cache of its own."""
    return {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url,
            "UPCYCLER_CACHE": str(tmp / "cache"), **more}


@pytest.fixture
def proxy():
    faulty = FaultyStorage(os.environ["STORAGE_EMULATOR_HOST"], seed=20261128)
    yield faulty
    faulty.stop()


@pytest.fixture(scope="module")
def inputs(ws, tiny_dir):
    """In the bucket: a tiny llama uploaded as a user's own (no upcycler.json: only the bucket's checksums
    can tell a damaged byte), the trainer's tiny dense model and the text of its two data sources."""
    root = gcs_emulator.unique_prefix("faults")
    llama = tiny_dir("llama")
    store.upload_all([(p, f"{root}/src/{p.relative_to(llama).as_posix()}") for p in sorted(llama.rglob("*"))
                      if p.is_file() and p.name != MANIFEST])
    dense = ws["dense"]
    store.upload_all([(p, f"{root}/dense/{p.relative_to(dense).as_posix()}") for p in sorted(dense.rglob("*"))
                      if p.is_file()])
    store.upload_all([(file, f"{root}/text/{name}/{file.name}") for name, files in F.SOURCES.items()
                      for file in files])
    return {"root": root, "llama": llama, "src": f"{root}/src", "dense": f"{root}/dense"}


def commands(inputs, ws, out: str, tmp: Path) -> list[tuple]:
    """dense-to-moe, merge and prepare-data writing under `out`, and a training config reading that data."""
    sources = [item for name in F.SOURCES for item in ("--source", f"{name}={inputs['root']}/text/{name}/*.py")]
    cfg = F.config_dict(tmp, ws["dense"], ws["data"], steps=STEPS, run_dir=f"{out}/run")
    cfg["model"]["init"], cfg["data"]["dir"] = inputs["dense"], f"{out}/data"
    return [
        ("dense-to-moe", inputs["src"], f"{out}/moe", "--experts", "4", "--topk", "2"),
        ("merge", inputs["src"], inputs["llama"], f"{out}/merged", "--method", "sma"),
        ("prepare-data", "--tokenizer", ws["tokenizer"], *sources, "--out", f"{out}/data", "--format", "text"),
        ("continued-pretrain", "--config", F.write_config(tmp / "train.yaml", cfg)),
    ]


@pytest.fixture(scope="module")
def clean(inputs, ws, tmp_path_factory):
    """The commands without the proxy: what every faulty run must write."""
    out, tmp = gcs_emulator.unique_prefix("clean"), tmp_path_factory.mktemp("clean")
    for argv in commands(inputs, ws, out, tmp):
        run_cli(*argv, timeout=600, env={"UPCYCLER_CACHE": str(tmp / "cache")})
    return out


def test_transient_faults_change_no_output(inputs, ws, clean, proxy, tmp_path):
    out = gcs_emulator.unique_prefix("faulty")
    transient = proxy.transient(RATE)
    flips = [proxy.flip_bit(inputs["src"].split("://")[1] + f"/{name}") for name in ("model.safetensors",
                                                                                     "config.json")]
    argv = commands(inputs, ws, out, tmp_path)
    for command in argv[:3]:
        run_cli(*command, timeout=600, env=cli_env(proxy, tmp_path))
    flips += [proxy.flip_bit(out.split("://")[1] + f"/data/{name}") for name in
              ("json.index.json", "json.shards/00000.tokens", "email.shards/00000.tokens")]
    flips.append(proxy.flip_bit(inputs["dense"].split("://")[1] + "/model.safetensors"))
    run_cli(*argv[3], timeout=900, env=cli_env(proxy, tmp_path))
    for name in ("moe", "merged", "data"):
        assert_same_objects(f"{out}/{name}", f"{clean}/{name}")
    assert_same_run(f"{out}/run", f"{clean}/run", tmp_path)
    assert set(transient.kinds_met) == set(TRANSIENT_KINDS), transient.kinds_met
    assert [flip.damaged for flip in flips] == [1] * len(flips)


def assert_same_run(run_dir: str, expected: str, tmp: Path) -> None:
    """The run at `run_dir` logged the metrics of the run at `expected` (timings aside) and its last step
    holds the same parameters, bit for bit (read with the public checkpoint reader)."""
    got, want = objects(run_dir), objects(expected)
    logs = [sorted(name for name in d if name.startswith("metrics-")) for d in (got, want)]
    assert logs[0] == logs[1] and logs[0]
    records = [[{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS}
                for name in names for line in d[name].decode().splitlines()] for d, names in zip((got, want), logs)]
    assert records[0] == records[1]
    params = []
    for n, (d, url) in enumerate(((got, run_dir), (want, expected))):
        for name in (name for name in d if name.startswith(f"{STEPS}/")):
            (tmp / f"step-{n}" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / f"step-{n}" / name).write_bytes(d[name])
        params.append(F.step_params(tmp / f"step-{n}" / str(STEPS)))
    assert params[0].keys() == params[1].keys() and all(np.array_equal(params[0][k], params[1][k]) for k in params[1])


@pytest.mark.parametrize("damaged", ["config.json", "json.index.json", "json.shards/00000.tokens"])
def test_an_object_damaged_on_every_read_is_refused_and_a_rerun_succeeds(inputs, ws, clean, proxy, tmp_path,
                                                                          damaged):
    """Every download of the object arrives with a bit flipped: the command ends in one line naming it,
    having read it twice; with the damage gone, the same command and cache write what the clean run did."""
    if damaged == "config.json":
        argv, out, damaged_url = commands(inputs, ws, "unused", tmp_path)[0], None, f"{inputs['src']}/config.json"
        out = gcs_emulator.unique_prefix("refused") + "/moe"
        argv = (*argv[:2], out, *argv[3:])
        says, expected = f"'{damaged_url}': downloaded 2 times, its bytes never matched", f"{clean}/moe"
    else:
        data = gcs_emulator.unique_prefix("refused-data")
        for name, data_object in objects(f"{clean}/data").items():
            store.write_bytes(f"{data}/{name}", data_object)
        damaged_url, run_dir = f"{data}/{damaged}", gcs_emulator.unique_prefix("refused-run")
        cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=STEPS, run_dir=run_dir)
        cfg["model"]["init"], cfg["data"]["dir"] = inputs["dense"], data
        argv, out = ("continued-pretrain", "--config", F.write_config(tmp_path / "train.yaml", cfg)), run_dir
        says = (f"{damaged_url}: read 2 times, its bytes never matched" if damaged.endswith(".json") else
                f"{damaged_url}: block 0 (bytes 128-")
        expected = f"{clean}/run"
    fault = proxy.flip_bit(damaged_url.split("://")[1], times=None, from_byte=128 if damaged.endswith(".tokens") else 0)
    failed = run_cli(*argv, check=False, timeout=900, env=cli_env(proxy, tmp_path))
    assert_clean_failure(without_credentials_notice(failed), mentions=says)
    assert fault.damaged >= 2
    if damaged == "config.json":
        assert objects(out) == {}
    proxy.faults.clear()
    run_cli(*argv, timeout=900, env=cli_env(proxy, tmp_path))
    if damaged == "config.json":
        assert_same_objects(out, expected)
    else:
        assert_same_run(out, expected, tmp_path)


def ends_in_one_line(proc, *, mentions: str) -> str:
    """A failure whose stderr ends in its only `error:` line, which mentions `mentions` (the notes a command
    printed while it worked come before it), with no traceback; that line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert errors == lines[-1:] and mentions in errors[0], proc.stderr
    return errors[0]


def without_credentials_notice(proc):
    """`proc` without the line tensorstore logs when it finds no Google credentials (the emulator needs none)."""
    import subprocess

    kept = [line for line in proc.stderr.splitlines(keepends=True) if "google_auth_provider.cc" not in line]
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, "".join(kept))


@pytest.mark.parametrize("command", ["dense-to-moe", "prepare-data"])
def test_a_bucket_that_refuses_every_write_ends_within_the_deadline(inputs, ws, proxy, tmp_path, command):
    """Every write under the output answered 503 for good: one line naming the output, within the retry
    policy's deadline (5 s here) per request, and nothing there that reads as finished."""
    out = gcs_emulator.unique_prefix("no-writes")
    argv = {c[0]: c for c in commands(inputs, ws, out, tmp_path)}[command]
    fault = proxy.refuse_writes(out.split("://")[1])
    started = time.monotonic()
    failed = run_cli(*argv, check=False, timeout=300, env=cli_env(proxy, tmp_path, UPCYCLER_GCS_DEADLINE="5"))

    seconds = time.monotonic() - started
    line = ends_in_one_line(failed, mentions=out)
    assert "503" in line and fault.damaged > 0 and seconds < 90, (seconds, line)
    left = objects(out)
    assert not [name for name in left if name.endswith((MANIFEST, ".index.json"))] and WRITING not in left
    assert np.all([not name.endswith("model.safetensors") for name in left])
