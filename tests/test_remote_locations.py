"""Model sources and outputs in a bucket (`gs://`, against the run's loopback emulator) and on the Hub.

The strong check: the same commands on local paths and on bucket URLs write the same bytes. Every output
file is compared byte for byte with the local run's; the manifests are equal once the local paths are
read as the bucket URLs they stand for (the lineage records the bucket URL, not the local cache). The
commit protocol is checked at every point a write can die (a real SIGKILL between uploads, and an
interrupted publish before, between and after the uploads): no reader takes the output as finished, and
the next write to the same place succeeds without `--overwrite`. Locations that leave their root (a URL
with `..`, an object listed or matched by a glob under such a name, through a proxy that lists what the
emulator cannot hold) are refused before anything is fetched, written or deleted: a victim file where
the escape would land keeps its bytes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import gcs_emulator
import pytest
from cli_helpers import assert_clean_failure, run_cli
from faulty_storage import FaultyStorage
from hub_server import FakeHub

from upcycler import bucket_client
from upcycler.errors import UpcyclerError
from upcycler.io import bucket_output, write_lock
from upcycler.io import object_store as store
from upcycler.io.manifest import MANIFEST
from upcycler.io.remote_sources import mirror

pytestmark = pytest.mark.skipif(not gcs_emulator.is_running(), reason="the run's storage emulator is not set")


def bucket_files(url: str) -> dict[str, bytes]:
    """Every object under `url`, read with gcsfs directly (not through the code under test)."""
    from gcsfs.core import GCSFileSystem

    fs = GCSFileSystem(token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"], skip_instance_cache=True)
    prefix = url.split("://", 1)[1] + "/"
    return {key[len(prefix):]: fs.cat_file(key) for key in fs.find(prefix)}


def local_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def assert_same_output(url: str, local: Path, stands_for: dict[str, str]) -> None:
    """The objects at `url` are the files of `local`, byte for byte; the manifest once `stands_for` (local
    path → URL) is applied to the local one."""
    remote, here = bucket_files(url), local_files(local)
    assert sorted(remote) == sorted(here), url
    for name in here:
        if name != MANIFEST:
            assert remote[name] == here[name], (url, name)
    text = here[MANIFEST].decode()
    for path, where in stands_for.items():
        text = text.replace(json.dumps(path)[1:-1], where)
    assert json.loads(remote[MANIFEST]) == json.loads(text)


@pytest.fixture(scope="module")
def surgery(tiny_dir, tmp_path_factory):
    """convert, depth, dense-to-moe (also with --experts-from) and merge, once on local paths and once
    on bucket URLs, each reading the previous step's output."""
    model = tiny_dir("llama")
    local, bucket = tmp_path_factory.mktemp("local"), gcs_emulator.unique_prefix("surgery")
    runs = {}
    for root in (str(local), bucket):
        at = (lambda name, root=root: f"{root}/{name}")
        runs[root] = [
            run_cli("convert", model, at("conv"), timeout=120),
            run_cli("depth", at("conv"), at("deep"), "--layers", "4", timeout=120),
            run_cli("dense-to-moe", at("conv"), at("moe"), "--experts", "4", "--topk", "2", timeout=120),
            run_cli("dense-to-moe", at("conv"), at("btx"), "--experts", "4", "--topk", "2", "--experts-from",
                    f"a={at('conv')}", f"b={model}", timeout=120),
            run_cli("merge", at("conv"), model, at("merged"), "--method", "sma", timeout=120),
        ]
    return {"model": model, "local": local, "bucket": bucket, "runs": runs}


NAMES = ("conv", "deep", "moe", "btx", "merged")


@pytest.mark.parametrize("name", NAMES)
def test_surgery_writes_the_same_bytes_to_a_bucket(surgery, name):
    local = surgery["local"]
    bucket = surgery["bucket"]
    assert_same_output(f"{bucket}/{name}", local / name,
                       {str(local / n): f"{bucket}/{n}" for n in NAMES})
    assert bucket_output.WRITING not in bucket_files(f"{bucket}/{name}")


def test_reading_commands_take_bucket_urls(surgery):
    local = surgery["local"]
    bucket = surgery["bucket"]
    runs = surgery["runs"]
    assert all("published gs://" in proc.stdout for proc in runs[bucket])
    remote = json.loads(run_cli("inspect", f"{bucket}/moe", "--json", timeout=60).stdout)
    here = json.loads(run_cli("inspect", local / "moe", "--json", timeout=60).stdout)
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in here.items() if k != "path"}
    verdict = run_cli("verify", f"{bucket}/moe", local / "moe", timeout=120).stdout
    assert "same function" in verdict, verdict


def test_eval_reads_a_model_in_a_bucket(tmp_path):
    """`upcycle eval gs://…` gives the local model's numbers: the demo model (it has a tokenizer) in the
    bucket, two prompts teacher-forced against the same model read locally (--vs)."""
    from upcycler.cli.demo import demo_assets

    model, url = demo_assets() / "model", gcs_emulator.unique_prefix("eval") + "/demo"
    run_cli("convert", model, url, timeout=120)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def __init__(self", "answer": "):"}\n{"prompt": "The answer is"}\n')
    result = json.loads(run_cli("eval", url, "--vs", model, "--task", "prompts", prompts, "--json", timeout=300).stdout)
    assert len(result["items"]) == 2
    for item in result["items"]:
        assert item["model"] == item["vs"] and item["kl"] == 0 and item["top1_agree"], item


def test_a_recipe_reads_and_writes_a_bucket(surgery, tmp_path):
    """`upcycle run` with the recipe's source and output.path in the bucket writes what `dense-to-moe`
    wrote from the same source; its lineage names the bucket source."""
    local, bucket = surgery["local"], surgery["bucket"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"source: {bucket}/conv\ntransforms:\n  - dense-to-moe: {{experts: 4, topk: 2}}\n"
                      f"output: {{path: {bucket}/from-recipe}}\n")
    run_cli("run", recipe, timeout=120)
    written = bucket_files(f"{bucket}/from-recipe")
    assert written["model.safetensors"] == local_files(local / "moe")["model.safetensors"]
    assert json.loads(written[MANIFEST])["lineage"][-1]["recipe"]["source"] == f"{bucket}/conv"
    recipe.write_text(recipe.read_text().replace(f"{bucket}/from-recipe", "s3://bkt/out"))
    assert_clean_failure(run_cli("run", recipe, check=False), mentions="output.path: 's3://bkt/out': s3://")


def test_bucket_outputs_keep_the_output_rules(surgery, tmp_path, monkeypatch):
    model = surgery["model"]
    bucket = surgery["bucket"]
    monkeypatch.chdir(tmp_path)
    before = bucket_files(f"{bucket}/conv")
    cases = {  # argv: what the one error line says
        ("convert", model, f"{bucket}/conv"): "already exists; choose another output or pass --overwrite",
        ("convert", f"{bucket}/conv", f"{bucket}/conv/inner"): "lies inside the source",
        ("convert", f"{bucket}/conv", bucket, "--overwrite"): "contains the source",
    }
    store.write_bytes(f"{bucket}/foreign/notes.txt", b"not ours")
    cases[("convert", model, f"{bucket}/foreign", "--overwrite")] = "holds objects upcycler did not write"
    for argv, says in cases.items():
        assert_clean_failure(run_cli(*argv, check=False, timeout=60), mentions=says)
    assert bucket_files(f"{bucket}/conv") == before
    assert bucket_files(f"{bucket}/foreign") == {"notes.txt": b"not ours"}
    assert list(tmp_path.iterdir()) == []
    run_cli("convert", model, f"{bucket}/conv", "--overwrite", "--dtype", "bf16", timeout=120)
    after = bucket_files(f"{bucket}/conv")
    assert sorted(after) == sorted(before) and after["model.safetensors"] != before["model.safetensors"]


KILL_AFTER_FIRST_UPLOAD = """
import sys, time
from pathlib import Path
from upcycler.io import bucket_output, object_store as store
upload_all = store.upload_all
def upload_then_hang(pairs):
    upload_all(pairs[:1])
    print("uploaded", flush=True)
    time.sleep(600)
store.upload_all = upload_then_hang
bucket_output.publish(Path(sys.argv[1]), sys.argv[2])
"""


def test_a_write_killed_mid_publish_never_looks_finished(surgery, tmp_path):
    local = surgery["local"]
    bucket = surgery["bucket"]
    out = f"{bucket}/killed"
    proc = subprocess.Popen([sys.executable, "-c", KILL_AFTER_FIRST_UPLOAD, str(local / "moe"), out],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "uploaded"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    left = bucket_files(out)
    assert bucket_output.WRITING in left and MANIFEST not in left and len(left) == 2
    proc = run_cli("inspect", out, check=False, timeout=60)
    assert_clean_failure(proc, mentions="an unfinished upcycler write")
    run_cli("convert", local / "moe", out, timeout=120)  # no --overwrite needed over a killed write
    assert sorted(bucket_files(out)) == sorted(local_files(local / "moe"))


@pytest.mark.parametrize("when", ["before the uploads", "between uploads", "before the commit"])
def test_an_interrupted_publish_is_refused_and_cleaned_up(surgery, monkeypatch, when):
    """Interrupted before any upload, after one, or after every file (the manifest last) but before the
    commit (the marker's deletion)."""
    local = surgery["local"]
    out, uploaded = gcs_emulator.unique_prefix("interrupted"), []
    real_upload_all, real_remove = store.upload_all, store.remove

    def upload_all(pairs):
        for path, url in pairs:
            if when != "before the commit" and len(uploaded) == {"before the uploads": 0, "between uploads": 1}[when]:
                raise KeyboardInterrupt
            uploaded.append(url)
            real_upload_all([(path, url)])

    def remove(urls):
        if any(url.endswith(f"/{bucket_output.WRITING}") for url in urls):
            raise KeyboardInterrupt
        real_remove(urls)

    monkeypatch.setattr(store, "upload_all", upload_all)
    monkeypatch.setattr(store, "remove", remove)
    with pytest.raises(KeyboardInterrupt):
        bucket_output.publish(local / "moe", out)
    monkeypatch.setattr(store, "upload_all", real_upload_all)
    monkeypatch.setattr(store, "remove", real_remove)
    if when == "before the commit":
        assert uploaded[-1].endswith(f"/{MANIFEST}") and len(uploaded) == len(local_files(local / "moe"))
    with pytest.raises(UpcyclerError, match="an unfinished upcycler write"):
        mirror(out)
    bucket_output.check_output(out, overwrite=False)  # a killed write's leftovers need no --overwrite
    bucket_output.publish(local / "moe", out)
    assert bucket_files(out) == local_files(local / "moe")


# --- one writer per bucket output: races, an expired lease, a lost lease ---------------------------

HOLDER = re.compile(r"being written by another upcycler process \(host \S+, pid \d+, since \d{4}-\d\d-\d\d "
                    r"\d\d:\d\d:\d\d UTC\); wait for it to finish or choose another output")
RACES = 20


@pytest.mark.heavy  # 40 rounds against the emulator: about 20 s
def test_two_writers_of_one_bucket_output_one_wins_every_time():
    """Lock, check, publish raced by two processes started at once, 20 times, on the emulator: one
    publishes, the other is refused in one line naming it; the lock object is gone after. Then the same
    race on the finished outputs, without --overwrite: both refused, and the outputs unchanged."""
    from lock_racers import race

    root = gcs_emulator.unique_prefix("race")
    for k, outcomes in enumerate(race("bucket", RACES, url=f"{root}/r{{round}}/out")):
        won = [d for status, d in outcomes if status == "ok"]
        refused = [d for status, d in outcomes if status == "refused"]
        assert len(won) == 1 and len(refused) == 1 and HOLDER.search(refused[0]), outcomes
        assert json.loads(bucket_files(f"{root}/r{k}/out")[MANIFEST]) == {"writer": int(won[0])}
        assert sorted(bucket_files(f"{root}/r{k}")) == ["out/upcycler.json", "out/weights.bin"]
    before = bucket_files(root)
    for outcomes in race("bucket", RACES, url=f"{root}/r{{round}}/out"):
        assert [status for status, _ in outcomes] == ["refused", "refused"], outcomes
        assert all(HOLDER.search(d) or "already exists; choose another output or pass --overwrite" in d
                   for _, d in outcomes), outcomes
    assert bucket_files(root) == before


HOLD_A_LEASE = """
import sys, time
from upcycler.io import lock_holder, write_lock
if sys.argv[3] == "elsewhere":
    lock_holder.here = lambda: "another machine"
with write_lock.locked(write_lock.output_lock(sys.argv[1]), "busy", "wait", lease_seconds=float(sys.argv[2])):
    print("holding", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("where", ["here", "elsewhere"])
def test_the_lease_of_a_killed_writer_is_taken_over(surgery, where):
    """A writer killed (SIGKILL) while it holds a bucket output's lease: on this machine (same boot, same pid
    namespace) its lease is taken over at once; from another machine it is kept until it expires (the next
    writer is refused, naming it), not longer. Then the next writer takes it over and publishes."""
    out, lease = gcs_emulator.unique_prefix("expired") + "/out", 2.0
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_LEASE, out, str(lease), where], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
    finally:
        holder.kill()
        holder.wait()
    killed = time.time()
    if where == "elsewhere":
        with pytest.raises(UpcyclerError, match=rf"pid {holder.pid}, since"), bucket_output.locked(out):
            pass
        time.sleep(max(0.0, killed + lease + 0.2 - time.time()))
    with bucket_output.locked(out) as lock:
        bucket_output.check_output(out, overwrite=False)
        bucket_output.publish(surgery["local"] / "moe", out, lock=lock)
    assert bucket_files(out) == local_files(surgery["local"] / "moe")
    assert store.object_info(write_lock.output_lock(out)) is None, "the lease was not released"


def test_a_writer_whose_lease_was_taken_over_commits_nothing(surgery):
    """A holder that stopped renewing (stalled past its lease) finds, at its next renewal, that another process
    took the lease over: it knows it lost it, and `publish` with it uploads nothing and commits nothing."""
    from upcycler.io.bucket_lease import Lease

    out = gcs_emulator.unique_prefix("lost") + "/out"
    stalled = Lease(write_lock.output_lock(out), "busy", "wait", 0.5)
    stalled.acquire()
    stalled._stop.set()  # its renewals stall
    stalled._thread.join()
    time.sleep(0.7)
    with bucket_output.locked(out):  # taken over
        assert not stalled.renew() and "taken over by host" in stalled.lost
        with pytest.raises(UpcyclerError, match="this process lost its lock .taken over by host .*; nothing was "
                                                "committed"):
            bucket_output.publish(surgery["local"] / "moe", out, lock=stalled)
    assert bucket_files(out) == {}


def test_two_converts_into_one_bucket_output_one_wins(surgery):
    """The full CLI on the emulator: two `convert`s (bf16 and fp32) into one gs:// OUT at once: one
    publishes, the other exits 2 with one line (naming the writer, or the finished output)."""
    out = gcs_emulator.unique_prefix("cli-race") + "/out"
    procs = {dtype: subprocess.Popen([sys.executable, "-m", "upcycler", "convert", surgery["model"], out, "--dtype",
                                      dtype], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for dtype in ("bf16", "fp32")}
    done = {dtype: (proc.wait(timeout=600), proc.stderr.read()) for dtype, proc in procs.items()}
    assert sorted(status for status, _ in done.values()) == [0, 2], done
    [loser] = [stderr for status, stderr in done.values() if status == 2]
    lines = [line for line in loser.splitlines() if line.strip()]
    assert len(lines) == 1 and (HOLDER.search(lines[0]) or "already exists" in lines[0]), loser
    objects = bucket_files(out)
    assert MANIFEST in objects and bucket_output.WRITING not in objects


def test_a_hub_id_is_a_source_for_dense_to_moe(surgery, tmp_path, monkeypatch):
    """The fake Hub serves the converted model as org/tiny; `dense-to-moe org/tiny` writes the bytes the
    local source gives, and the lineage names the Hub id and the commit it read. `push` takes its
    directory from a bucket and uploads its objects as they are."""
    import huggingface_hub
    from huggingface_hub import HfApi

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    local = surgery["local"]
    env = {"HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "t"}
    with FakeHub() as hub:
        env["HF_ENDPOINT"] = hub.url
        api = HfApi(endpoint=hub.url, token="t")
        api.create_repo("org/tiny")
        api.upload_folder(repo_id="org/tiny", folder_path=str(local / "conv"))
        api.upload_file(path_or_fileobj=b"\0" * 1024, path_in_repo="original/consolidated.00.pth",
                        repo_id="org/tiny")  # another copy of the weights, never fetched
        run_cli("dense-to-moe", "org/tiny", tmp_path / "moe", "--experts", "4", "--topk", "2", env=env,
                timeout=120)
        run_cli("push", f"{surgery['bucket']}/moe", "org/moe", "--endpoint", hub.url, env=env, timeout=120)
        pushed = hub.files("org/moe")
    written = local_files(tmp_path / "moe")
    expected = local_files(local / "moe")
    assert written["model.safetensors"] == expected["model.safetensors"]
    lineage = json.loads(written[MANIFEST])["lineage"]
    reads = [step for step in lineage if step["step"] == "read"]
    assert reads[-1]["source"] == "org/tiny" and len(reads[-1]["revision"]) == 40
    assert not list((tmp_path / "hf").rglob("*.pth"))
    assert {k: v for k, v in pushed.items() if k != "README.md"} == local_files(surgery["local"] / "moe") \
        | {MANIFEST: bucket_files(f"{surgery['bucket']}/moe")[MANIFEST]}


@pytest.fixture
def faulty():
    """A proxy in front of the run's emulator that damages the downloads a test names (`faulty_storage`)."""
    proxy = FaultyStorage(os.environ["STORAGE_EMULATOR_HOST"], seed=20240611)
    yield proxy
    proxy.stop()


@contextmanager
def faulty_endpoint(proxy: FaultyStorage):
    """This process's bucket client pointed at `proxy` inside the block, at the emulator again after it."""
    emulator = os.environ["STORAGE_EMULATOR_HOST"]
    os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
    store.filesystem.cache_clear()
    try:
        yield
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = emulator
        store.filesystem.cache_clear()


def users_upload(surgery) -> str:
    """The converted model uploaded as a user's own (no upcycler.json: nothing but the bucket's checksums
    can tell a damaged byte); its URL."""
    url, conv = gcs_emulator.unique_prefix("upload") + "/src", surgery["local"] / "conv"
    store.upload_all([(path, f"{url}/{path.relative_to(conv).as_posix()}") for path in sorted(conv.rglob("*"))
                      if path.is_file() and path.name != MANIFEST])
    return url


def test_a_flipped_bit_in_a_bucket_source_is_read_again(surgery, faulty, tmp_path):
    """The first download of a user's model.safetensors arrives with one bit flipped: it is fetched again
    and dense-to-moe writes what it writes from the local source."""
    src = users_upload(surgery)
    out = src.rsplit("/", 1)[0] + "/moe"
    fault = faulty.flip_bit(src.split("://", 1)[1] + "/model.safetensors", times=1)
    run_cli("dense-to-moe", src, out, "--experts", "4", "--topk", "2", timeout=120,
            env={"STORAGE_EMULATOR_HOST": faulty.url, "UPCYCLER_CACHE": str(tmp_path / "cache")})
    assert fault.damaged == 1
    assert bucket_files(out)["model.safetensors"] == local_files(surgery["local"] / "moe")["model.safetensors"]


def test_a_corrupt_download_is_refused_and_a_rerun_reads_it_afresh(surgery, faulty, tmp_path):
    """Every download of model.safetensors damaged: refused in one line naming the object, after one more
    try; nothing is published and nothing of it stays in the mirror. Once the fault is gone, the same
    command with the same cache succeeds."""
    src = users_upload(surgery)
    out, cache = src.rsplit("/", 1)[0] + "/moe", tmp_path / "cache"
    fault = faulty.flip_bit(src.split("://", 1)[1] + "/model.safetensors", times=None)
    argv = ("dense-to-moe", src, out, "--experts", "4", "--topk", "2")
    env = {"STORAGE_EMULATOR_HOST": faulty.url, "UPCYCLER_CACHE": str(cache)}
    proc = run_cli(*argv, check=False, timeout=120, env=env)
    line = assert_clean_failure(proc, mentions=f"'{src}/model.safetensors': downloaded 2 times, its bytes never "
                                               "matched the CRC32C the bucket holds for it")
    assert "upload it again" in line and fault.damaged == 2
    assert bucket_files(out) == {}
    assert not [p.name for p in cache.rglob("*") if "model.safetensors" in p.name]
    faulty.faults.clear()
    run_cli(*argv, timeout=120, env=env)
    assert bucket_files(out)["model.safetensors"] == local_files(surgery["local"] / "moe")["model.safetensors"]


def test_a_mirrored_copy_is_trusted_only_as_it_was_verified(tmp_path, monkeypatch):
    """A copy changed since it was verified (cut short), or recorded by a mirror that did not verify (the
    generation alone, over a copy of the right size with other bytes), is fetched again, not read."""
    monkeypatch.setenv("UPCYCLER_CACHE", str(tmp_path))
    url, data = gcs_emulator.unique_prefix("trusted"), bytes(range(256)) * 64
    store.write_bytes(f"{url}/weights.bin", data)
    copy = mirror(url) / "weights.bin"
    record = copy.parent.parent / f".{copy.parent.name}.mirror.json"
    generation = json.loads(record.read_text())["weights.bin"]["generation"]
    copy.write_bytes(data[:100])
    assert mirror(url) == copy.parent and copy.read_bytes() == data
    copy.write_bytes(bytes(reversed(data)))
    record.write_text(json.dumps({"weights.bin": generation}))
    assert mirror(url) == copy.parent and copy.read_bytes() == data


def test_a_bucket_model_is_named_by_its_url_not_its_cache_path(tmp_path):
    """A bucket prefix without config.json: the error names the gs:// URL the user gave."""
    url = gcs_emulator.unique_prefix("no-config") + "/model"
    store.write_bytes(f"{url}/README.md", b"not a checkpoint")
    line = assert_clean_failure(run_cli("inspect", url, check=False, env={"UPCYCLER_CACHE": str(tmp_path)},
                                        timeout=60), mentions="no config.json")
    assert line.startswith(f"error: {url}: no config.json"), line
    assert str(tmp_path) not in line


def test_a_probe_tells_a_missing_bucket_from_an_empty_prefix():
    store.probe(gcs_emulator.unique_prefix("nothing-here"))  # an empty prefix of a bucket that exists
    with pytest.raises(UpcyclerError, match=r"^'gs://upcycler-no-such-bucket/run': no such bucket"):
        store.probe("gs://upcycler-no-such-bucket/run")


def refusing_endpoint() -> str:
    """A loopback URL where nothing listens: every connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def silent_endpoint():
    """A loopback URL that accepts connections (the kernel's backlog) and never answers a byte."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def timed_cli(*args, **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = run_cli(*args, check=False, **kwargs)
    return proc, time.monotonic() - started


UNREACHABLE = {  # command: argv, with {model}, {tokenizer}, {text} and {url} filled in; its deadline (None: default)
    "inspect": (["inspect", "{url}/model"], None),
    "convert": (["convert", "{model}", "{url}/out"], 2),
    "prepare-data": (["prepare-data", "--tokenizer", "{tokenizer}", "--out", "{url}/data", "--source", "a={text}"],
                     2),
}


@pytest.mark.parametrize("command", UNREACHABLE)
def test_an_unreachable_bucket_is_one_line_within_the_deadline(command, tiny_dir, tmp_path, monkeypatch):
    """Connections refused: the retry policy gives up within its deadline (the default's, or a short one
    set by UPCYCLER_GCS_DEADLINE), in one line that names the endpoint and the variable to check; nothing
    is written locally."""
    from upcycler.cli.demo import demo_assets

    text = tmp_path / "in" / "a.jsonl"
    text.parent.mkdir()
    text.write_text('{"text": "hello"}\n')
    given = {"{model}": str(tiny_dir("llama")), "{tokenizer}": str(demo_assets() / "tokenizer.json"),
             "{text}": str(text), "{url}": "gs://upcycler-tests/unreachable"}
    endpoint, work = refusing_endpoint(), tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    template, deadline = UNREACHABLE[command]
    argv = [functools.reduce(lambda a, pair: a.replace(*pair), given.items(), a) for a in template]
    env = {"STORAGE_EMULATOR_HOST": endpoint, "UPCYCLER_CACHE": str(tmp_path / "cache")}
    if deadline is not None:
        env["UPCYCLER_GCS_DEADLINE"] = str(deadline)
    proc, seconds = timed_cli(*argv, env=env, timeout=120)
    line = assert_clean_failure(proc, mentions=f"Cloud Storage at {endpoint} does not answer (connection refused")
    assert "check STORAGE_EMULATOR_HOST" in line and "gs://upcycler-tests/unreachable" in line
    assert seconds < (deadline or bucket_client.RetryPolicy.deadline) + 10, seconds
    assert list(work.iterdir()) == [] and not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_a_silent_bucket_endpoint_is_given_up_at_the_deadline(tmp_path, monkeypatch):
    """An endpoint that accepts connections and never answers: given up once UPCYCLER_GCS_DEADLINE has
    passed, in one line."""
    monkeypatch.chdir(tmp_path)
    with silent_endpoint() as endpoint:
        proc, seconds = timed_cli("inspect", "gs://upcycler-tests/silent", timeout=120,
                                  env={"STORAGE_EMULATOR_HOST": endpoint, "UPCYCLER_GCS_DEADLINE": "3"})
    assert_clean_failure(proc, mentions=f"Cloud Storage at {endpoint} does not answer (no answer in time")
    assert 3 <= seconds < 3 + 10, seconds
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("variable", "value"), [("UPCYCLER_GCS_DEADLINE", "soon"), ("UPCYCLER_GCS_DEADLINE", "-1"),
                                                  ("UPCYCLER_GCS_DEADLINE", "inf"), ("UPCYCLER_GCS_ATTEMPTS", "0"),
                                                  ("UPCYCLER_GCS_ATTEMPTS", "2.5")])
def test_a_bad_retry_setting_is_one_line(variable, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_cli("inspect", "gs://upcycler-tests/any", check=False, env={variable: value}, timeout=60)
    assert_clean_failure(proc, mentions=f"{variable}={value!r}: must be")


def test_tensorstore_retries_as_the_policy_says_within_its_deadline():
    """tensorstore has no deadline: its retries are as many as fit in it, pauses and jitter counted, and
    every context Orbax makes carries them."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    policy = bucket_client.RetryPolicy()
    assert bucket_client.tensorstore_retries(policy) == {"max_retries": 5, "initial_delay": "0.5s",
                                                         "max_delay": "8.0s"}
    for deadline, retries in ((3, 2), (1, 1), (0.5, 0), (600, policy.attempts - 1)):
        assert bucket_client.tensorstore_retries(bucket_client.RetryPolicy(deadline=deadline))["max_retries"] == retries
    bucket_client.configure_tensorstore()
    for ocdbt in (True, False):
        context = tensorstore_utils.get_ts_context(use_ocdbt=ocdbt)
        assert context["gcs_request_retries"].to_json() == {"max_retries": 5, "initial_delay": "500ms",
                                                              "max_delay": "8s"}


def test_the_retry_policy_gives_up_at_its_deadline_and_takes_an_answer_at_once(monkeypatch):
    """In process: a dropped connection is retried until the deadline would pass; a missing object (an
    answer) fails at the first try."""
    import asyncio

    import aiohttp

    monkeypatch.setenv("UPCYCLER_GCS_DEADLINE", "1.5")
    tries = []

    async def attempt(error: Exception):
        tries.append(time.monotonic())
        raise error

    started = time.monotonic()
    with pytest.raises(bucket_client.StorageUnanswered, match="dropped without an answer"):
        asyncio.run(bucket_client.retried(lambda: attempt(aiohttp.ServerDisconnectedError())))
    assert 2 <= len(tries) and time.monotonic() - started < 1.5
    tries.clear()
    with pytest.raises(FileNotFoundError):
        asyncio.run(bucket_client.retried(lambda: attempt(FileNotFoundError("gs://b/x"))))
    assert len(tries) == 1


def test_a_retrying_storage_shows_in_the_progress_line(monkeypatch, capsys):
    """While a request waits to be tried again it is counted (and no longer once it is answered); a run's
    progress says so in its step line and, between steps, in a note of the watcher."""
    import asyncio

    import aiohttp

    from upcycler.train.reporting.progress import Progress

    seen = []

    async def attempt():
        seen.append(bucket_client.storage_retrying())
        if len(seen) < 3:
            raise aiohttp.ServerDisconnectedError()
        return "answer"

    assert asyncio.run(bucket_client.retried(attempt)) == "answer"
    assert seen[0] is None and all(s.startswith("storage retrying: 1 request, ") for s in seen[1:])
    assert bucket_client.storage_retrying() is None
    progress = Progress(enabled=True, start=0, total=4, every=1, retry_note_every=0.05)
    monkeypatch.setitem(bucket_client._RETRYING, 1, (time.monotonic() - 6.0, 2))
    time.sleep(0.3)
    progress.update({"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0})
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "storage retrying: 1 request, 6 s"
    assert re.fullmatch(r"step 1: loss 2\.5000 lr 1\.00e-03 100 tok/s \(storage retrying: 1 request, [6-9] s\)",
                        lines[-1])


def test_an_object_stored_gzip_compressed_is_read_and_checked_by_gzip(faulty, tmp_path):
    """An object uploaded with `Content-Encoding: gzip` (its bucket CRC32C is of the compressed bytes) is
    mirrored and read whole as its content; a bit flipped on the way fails gzip's own CRC-32 and is read
    again, never kept."""
    import gzip

    url, data = gcs_emulator.unique_prefix("gzip") + "/config.json", b'{"hidden_size": 64}\n' * 500
    store.filesystem().pipe_file(url.split("://")[1], gzip.compress(data), fixed_key_metadata={"content_encoding": "gzip"})
    listed = store.object_info(url)
    store.download_checked([(url, listed, tmp_path / "plain.json")])
    assert (tmp_path / "plain.json").read_bytes() == data and store.read_bytes(url) == data
    with faulty_endpoint(faulty):
        mirrored = faulty.flip_bit(url.split("://")[1], times=1)
        store.download_checked([(url, listed, tmp_path / "through-faults.json")])
        read = faulty.flip_bit(url.split("://")[1], times=1)
        assert store.read_bytes(url) == data
    assert (tmp_path / "through-faults.json").read_bytes() == data and mirrored.damaged == read.damaged == 1


def test_an_upload_damaged_on_the_way_is_sent_again_or_refused(faulty, tmp_path):
    """The bucket's CRC32C of an uploaded file or written object is compared with the bytes sent: one
    damaged upload is sent again (the bucket then holds the file), one that is damaged every time is
    refused in one line naming the object."""
    url = gcs_emulator.unique_prefix("upload-check")
    local = tmp_path / "weights.bin"
    local.write_bytes(bytes(range(256)) * 64)
    with faulty_endpoint(faulty):
        once = faulty.flip_upload_bit(f"{url}/weights.bin".split("://")[1], times=1)
        store.upload_all([(local, f"{url}/weights.bin")])
        written = faulty.flip_upload_bit(f"{url}/marker".split("://")[1], times=1)
        store.write_bytes(f"{url}/marker", b"a marker")
        always = faulty.flip_upload_bit(f"{url}/again.bin".split("://")[1], times=2)
        with pytest.raises(UpcyclerError, match=r"again\.bin': written 2 times, the bucket never held the bytes"):
            store.upload_all([(local, f"{url}/again.bin")])
    assert once.damaged == written.damaged == 1 and always.damaged == 2
    assert bucket_files(url)["weights.bin"] == local.read_bytes() and bucket_files(url)["marker"] == b"a marker"


# --- locations that leave their root: refused before anything is read or written -------------------

LEAVE_FIX = "write gs://BUCKET/PATH with no '.', '..' or empty segment"


def bucket_key(url: str) -> str:
    return url.split("://", 1)[1]


def victim_dir(path: Path) -> dict[str, bytes]:
    """A user's directory where an escape would land: two files of their own; returns what it holds."""
    path.mkdir(parents=True)
    (path / "notes.txt").write_bytes(b"the user's own notes")
    (path / "config.json").write_bytes(b'{"mine": true}')
    return local_files(path)


def test_a_source_url_that_leaves_its_bucket_touches_nothing_outside_the_mirror(faulty, tiny_dir, tmp_path):
    """`inspect gs://B/P/../../../../victim`, where the bucket lists a config.json under that literal prefix
    (as Cloud Storage may): its mirror would be CACHE/../victim, whose config.json it would replace and whose
    other files its clean-up would delete. Refused in one line naming the URL before any request: the
    victim keeps its bytes, the prefix is never listed, nothing is cached."""
    root = gcs_emulator.unique_prefix("leave")
    store.write_bytes(f"{root}/model/config.json", (tiny_dir("llama") / "config.json").read_bytes())
    url = f"{root}/../../../../victim"
    listed = faulty.list_also(f"{bucket_key(url)}/config.json", f"{bucket_key(root)}/model/config.json")
    cache, before = tmp_path / "cache", victim_dir(tmp_path / "victim")
    proc = run_cli("inspect", url, check=False, timeout=60,
                   env={"STORAGE_EMULATOR_HOST": faulty.url, "UPCYCLER_CACHE": str(cache)})
    line = assert_clean_failure(proc, mentions=f"PATH: {url!r}: leaves 'gs://{gcs_emulator.BUCKET}' ('..' segments)")
    assert line.endswith(LEAVE_FIX), line
    assert local_files(tmp_path / "victim") == before and listed.damaged == 0
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_a_listed_object_that_leaves_its_prefix_is_never_fetched(faulty, tiny_dir, tmp_path):
    """A bucket model whose listing holds `../../../../../escape/config.json` (its copy: CACHE/../escape):
    dense-to-moe is refused in one line naming that object before anything is downloaded; the victim there
    keeps its bytes and nothing is published."""
    root = gcs_emulator.unique_prefix("listed")
    model = tiny_dir("llama")
    store.upload_all([(p, f"{root}/model/{p.name}") for p in sorted(model.iterdir()) if p.is_file()])
    faulty.list_also(f"{bucket_key(root)}/model/../../../../../escape/config.json",
                     f"{bucket_key(root)}/model/config.json")
    cache, before = tmp_path / "cache", victim_dir(tmp_path / "escape")
    proc = run_cli("dense-to-moe", f"{root}/model", f"{root}/moe", "--experts", "4", "--topk", "2", check=False,
                   timeout=120, env={"STORAGE_EMULATOR_HOST": faulty.url, "UPCYCLER_CACHE": str(cache)})
    line = assert_clean_failure(proc, mentions=f"'{root}/model/../../../../../escape/config.json': leaves '{root}/model'")
    assert line.endswith("; rename or remove that object"), line
    assert local_files(tmp_path / "escape") == before and bucket_files(f"{root}/moe") == {}
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".json"]  # no weights fetched


def test_a_glob_match_that_leaves_its_bucket_is_never_fetched_nor_read(faulty, tmp_path):
    """`prepare-data --source web=gs://B/P/pdesc/**` matching an object named `P/pdesc/../../../../../escape/
    x.jsonl` (its copy would be CACHE/../escape/x.jsonl): refused in one line naming the glob and the match,
    before anything is fetched; the victim file there keeps its bytes and no document of it is read."""
    from upcycler.cli.demo import demo_assets

    root = gcs_emulator.unique_prefix("glob")
    store.write_bytes(f"{root}/pdesc/a.jsonl", b'{"text": "hello"}\n')
    store.write_bytes(f"{root}/planted/x.jsonl", b'{"text": "planted"}\n')
    hostile = f"{root}/pdesc/../../../../../escape/x.jsonl"
    faulty.list_also(bucket_key(hostile), f"{bucket_key(root)}/planted/x.jsonl")
    victim = tmp_path / "escape" / "x.jsonl"
    victim.parent.mkdir()
    victim.write_bytes(b'{"text": "the user\'s own"}\n')
    cache = tmp_path / "cache"
    proc = run_cli("prepare-data", "--tokenizer", demo_assets() / "tokenizer.json", "--source",
                   f"web={root}/pdesc/**", "--out", tmp_path / "data", check=False, timeout=120,
                   env={"STORAGE_EMULATOR_HOST": faulty.url, "UPCYCLER_CACHE": str(cache)})
    line = assert_clean_failure(proc, mentions=f"'{root}/pdesc/**': its match {hostile!r}: leaves")
    assert line.endswith("; rename or remove that object, or narrow the glob"), line
    assert victim.read_bytes() == b'{"text": "the user\'s own"}\n'
    assert not (tmp_path / "data").exists() and not [p for p in cache.rglob("*") if p.is_file()]


@pytest.mark.parametrize("out", ["{root}/a/../b", "{root}/a/./b", "{root}/a//b"])
def test_an_output_url_with_a_dot_segment_writes_no_object(out, tiny_dir, tmp_path):
    """`convert SRC gs://B/P/a/../b` (and `.`, empty segments): refused in one line naming DST before any
    request; no object is written under P (the emulator, as a disk, would take `a/../b` for `b`), no lock,
    nothing staged."""
    root = gcs_emulator.unique_prefix("dots")
    url = out.format(root=root)
    proc = run_cli("convert", tiny_dir("llama"), url, check=False, timeout=60,
                   env={"UPCYCLER_CACHE": str(tmp_path / "cache")})
    line = assert_clean_failure(proc, mentions=f"DST: {url!r}: ")
    assert line.endswith(LEAVE_FIX), line
    assert bucket_files(root) == {} and not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_bucket_output_that_holds_an_object_with_a_dot_segment_is_left_alone(faulty, tiny_dir, tmp_path):
    """An earlier output at OUT whose listing holds `../../../victim/upcycler.json`: `convert --overwrite`
    is refused before it writes or deletes anything, naming that object; OUT keeps its objects."""
    root = gcs_emulator.unique_prefix("held")
    out = f"{root}/out"
    run_cli("convert", tiny_dir("llama"), out, timeout=120, env={"UPCYCLER_CACHE": str(tmp_path / "cache")})
    before = bucket_files(out)
    faulty.list_also(f"{bucket_key(out)}/../../../victim/{MANIFEST}", f"{bucket_key(out)}/{MANIFEST}")
    proc = run_cli("convert", tiny_dir("llama"), out, "--overwrite", check=False, timeout=120,
                   env={"STORAGE_EMULATOR_HOST": faulty.url, "UPCYCLER_CACHE": str(tmp_path / "cache")})
    line = assert_clean_failure(proc, mentions=f"'{out}/../../../victim/{MANIFEST}': leaves '{out}'")
    assert line.endswith("; delete that object yourself or choose another output"), line
    assert bucket_files(out) == before


def test_the_mirror_clean_up_never_reaches_outside_the_mirror(tmp_path, monkeypatch):
    """A mirror brought up to date deletes what the bucket no longer lists, and only that: links in it to
    a user's directory and file are removed themselves, never followed, and the victim keeps its bytes."""
    monkeypatch.setenv("UPCYCLER_CACHE", str(tmp_path / "cache"))
    url = gcs_emulator.unique_prefix("clean")
    store.write_bytes(f"{url}/weights.bin", b"the weights")
    local = mirror(url)
    before = victim_dir(tmp_path / "victim")
    (local / "linked").symlink_to(tmp_path / "victim", target_is_directory=True)
    (local / "notes.txt").symlink_to(tmp_path / "victim" / "notes.txt")
    (local / "stale").mkdir()
    (local / "stale" / "old.bin").write_bytes(b"gone from the bucket")
    assert mirror(url) == local
    assert local_files(tmp_path / "victim") == before
    assert sorted(p.name for p in local.iterdir()) == ["weights.bin"]
