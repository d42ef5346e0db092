"""Outputs never destroy inputs or unrelated files, corrupted sources are caught, leftovers are reclaimed.

Every case runs the real CLI in a subprocess against directories that also hold unrelated files, and
checks the contract: exit ≠ 0, one `error:` line naming the path, no traceback, every input byte and
mtime unchanged, nothing finished-looking left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli, snapshot
from tiny_models import make_tiny


def state(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory` with its bytes and mtime (an input must keep both)."""
    return {name: (data, (directory / name).stat().st_mtime_ns) for name, data in snapshot(directory).items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny HF model written by transformers, and the same model as an upcycler HF and Orbax output."""
    root = tmp_path_factory.mktemp("hostile-output")
    hf = make_tiny("llama", root / "hf", max_shard_size="60KB")
    run_cli("convert", hf, root / "ours")
    run_cli("convert", hf, root / "orbax", "--to", "orbax")
    return root


@pytest.fixture
def work(built, tmp_path):
    """A fresh copy of the fixtures, inside a directory that also holds a file of the user's."""
    for name in ("hf", "ours", "orbax"):
        shutil.copytree(built / name, tmp_path / name)
    (tmp_path / "notes.txt").write_text("the user's own file, not an output")
    return tmp_path


def fails_cleanly(proc, *, mentions: str, inputs: dict[Path, dict], parent: Path, out_name: str | None = None):
    line = assert_clean_failure(proc, mentions=mentions)
    for directory, before in inputs.items():
        assert state(directory) == before, f"{directory} was modified"
    assert (parent / "notes.txt").read_text() == "the user's own file, not an output"
    if out_name is not None:
        assert leftovers(parent, out_name) == [], "something that looks like an output was left behind"
    return line


# --- OUT overlapping a source --------------------------------------------------------------------

def test_convert_into_the_parent_of_the_source_is_refused(work):
    before = state(work / "hf")
    proc = run_cli("convert", work / "hf", work, "--overwrite", check=False)
    fails_cleanly(proc, mentions="contains the source", inputs={work / "hf": before}, parent=work)


@pytest.mark.parametrize("command", [
    ["depth", "--layers", "4"],
    ["dense-to-moe", "--experts", "2", "--topk", "2"],
    ["convert"],
])
def test_writing_over_the_source_itself_is_refused(work, command):
    before = state(work / "ours")
    proc = run_cli(command[0], work / "ours", work / "ours", *command[1:], "--overwrite", check=False)
    fails_cleanly(proc, mentions="is the source", inputs={work / "ours": before}, parent=work)


def test_output_inside_the_source_is_refused(work):
    before = state(work / "hf")
    proc = run_cli("depth", work / "hf", work / "hf" / "grown", "--layers", "4", check=False)
    fails_cleanly(proc, mentions="lies inside the source", inputs={work / "hf": before}, parent=work)
    assert not (work / "hf" / "grown").exists()


def test_output_through_a_symlink_to_the_source_is_refused(work):
    (work / "alias").symlink_to(work / "orbax", target_is_directory=True)
    before = state(work / "orbax")
    proc = run_cli("convert", work / "orbax", work / "alias", "--overwrite", check=False)
    fails_cleanly(proc, mentions="alias", inputs={work / "orbax": before}, parent=work)
    assert (work / "alias").is_symlink()


def test_recipe_writing_into_its_source_is_refused(work):
    recipe = work / "grow.yaml"
    recipe.write_text("source: ours\ntransforms:\n  - depth: {layers: 4}\noutput: {path: ours}\n")
    before = state(work / "ours")
    proc = run_cli("run", recipe, "--overwrite", check=False)
    fails_cleanly(proc, mentions="is the source", inputs={work / "ours": before}, parent=work)


def test_merge_into_the_parent_of_an_input_is_refused(work):
    before = {work / "ours": state(work / "ours"), work / "hf": state(work / "hf")}
    proc = run_cli("merge", work / "ours", work / "hf", work, "--method", "sma", "--overwrite", check=False)
    fails_cleanly(proc, mentions="contains the source", inputs=before, parent=work)


# --- --overwrite replaces only what upcycler wrote ---------------------------------------------

def test_overwrite_refuses_a_directory_of_other_files(work):
    out = work / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8 not a checkpoint")
    before = {work / "hf": state(work / "hf"), out: state(out)}
    proc = run_cli("convert", work / "hf", out, "--overwrite", check=False)
    fails_cleanly(proc, mentions="did not write", inputs=before, parent=work)
    assert [p.name for p in work.iterdir() if p.name.startswith(".photos.")] == []


def test_overwrite_refuses_a_file(work):
    out = work / "notes.txt"
    proc = run_cli("convert", work / "hf", out, "--overwrite", check=False)
    fails_cleanly(proc, mentions="not an upcycler output", inputs={work / "hf": state(work / "hf")}, parent=work)


def test_overwrite_replaces_an_empty_directory_and_an_earlier_output_leaving_nothing_behind(work):
    out = work / "out"
    out.mkdir()
    run_cli("convert", work / "hf", out, "--overwrite")
    (out / "extra.bin").write_bytes(b"x")
    run_cli("convert", work / "ours", out, "--to", "orbax", "--overwrite")
    assert (out / "params").is_dir() and not (out / "extra.bin").exists()
    assert leftovers(work, "out") == ["out"]


# --- leftovers of killed writes are reclaimed ----------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_dead_writers_are_reclaimed_and_live_ones_kept(work):
    dead, alive = _dead_pid(), os.getpid()
    names = {f".out.partial-{dead}-deadbeef": False, f".out.old-{dead}-deadbeef": False,
             ".out.partial-0a1b2c3d": False,  # written before leftovers carried a pid
             f".out.partial-{alive}-0badcafe": True}  # a writer that still runs
    for name in names:
        (work / name).mkdir()
        (work / name / "model.safetensors").write_bytes(b"\0" * 1024)
    run_cli("convert", work / "hf", work / "out")
    remaining = set(leftovers(work, "out"))
    assert remaining == {"out", f".out.partial-{alive}-0badcafe"}, remaining


def test_a_killed_write_leaves_a_partial_that_the_next_write_reclaims(work):
    big = make_tiny("llama", work / "big", hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                    vocab_size=8192)
    proc = subprocess.Popen([sys.executable, "-m", "upcycler", "convert", big, work / "out", "--shard-size", "1MB"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.name.startswith(".out.partial-") for p in work.iterdir()):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = [p.name for p in work.iterdir() if p.name.startswith(".out.partial-")]
    assert partial and not (work / "out").exists(), "the write was not interrupted while staging"
    run_cli("convert", big, work / "out")
    assert leftovers(work, "out") == ["out"]


# --- one writer per output: races, a killed holder, SIGTERM --------------------------------------

HOLDER = re.compile(r"\(host \S+, pid \d+, since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\); wait for it to finish")
RACES = 20


def _one_winner(outcomes: list[list[str]], out: Path) -> str:
    """Exactly one writer finished; every other was refused in one line naming the holder (or, had it come
    after the winner finished, naming the finished output); OUT is the winner's. Returns the winner."""
    won = [detail for status, detail in outcomes if status == "ok"]
    refused = [detail for status, detail in outcomes if status == "refused"]
    assert len(won) == 1 and len(refused) == len(outcomes) - 1, outcomes
    for line in refused:
        assert "\n" not in line and line.startswith(f"{out}: "), line
        assert HOLDER.search(line) or "already exists; choose another output or pass --overwrite" in line, line
    assert json.loads((out / "upcycler.json").read_text()) == {"writer": int(won[0])}
    assert leftovers(out.parent, out.name) == [out.name], "a lock or a partial was left behind"
    return won[0]


def test_two_writers_of_one_output_one_wins_and_the_other_is_refused_every_time(tmp_path):
    """`staged_directory` raced by two processes started at the same moment, 20 times: one writes OUT, the
    other is refused in one line naming the first (host, pid, since when)."""
    from lock_racers import race

    rounds = race("staged", RACES, out=f"{tmp_path}/r{{round}}/out")
    for k, outcomes in enumerate(rounds):
        _one_winner(outcomes, tmp_path / f"r{k}" / "out")
    assert sum(HOLDER.search(d) is not None for o in rounds for s, d in o if s == "refused") == RACES


@pytest.mark.heavy  # 40 rounds of three writers: about 20 s
def test_a_finished_output_is_never_replaced_without_overwrite_and_never_while_written(tmp_path):
    """Three writers at once on an existing upcycler output, 20 times: without --overwrite every one is
    refused and OUT is untouched; with --overwrite one replaces it and the others are refused, naming it
    (--overwrite never replaces an output another process is writing)."""
    from lock_racers import race

    for k in range(RACES):
        (tmp_path / f"r{k}" / "out").mkdir(parents=True)
        (tmp_path / f"r{k}" / "out" / "upcycler.json").write_text(json.dumps({"writer": "earlier"}))
    for outcomes in race("staged", RACES, writers=3, out=f"{tmp_path}/r{{round}}/out"):
        assert [s for s, _ in outcomes] == ["refused"] * 3, outcomes
    for k in range(RACES):
        assert json.loads((tmp_path / f"r{k}" / "out" / "upcycler.json").read_text()) == {"writer": "earlier"}
    for k, outcomes in enumerate(race("staged", RACES, writers=3, out=f"{tmp_path}/r{{round}}/out",
                                      overwrite=True, hold=0.3)):
        _one_winner(outcomes, tmp_path / f"r{k}" / "out")


def test_the_final_rename_refuses_an_output_that_appeared_meanwhile(tmp_path):
    """An OUT made by someone else while the write ran (not through upcycler, so not locked) is not
    replaced without --overwrite: the write is refused at its rename, and nothing of it is left."""
    from upcycler.errors import UpcyclerError
    from upcycler.io.staging import staged_directory

    out = tmp_path / "out"
    appeared = "out: appeared while this command wrote it; choose another output or pass --overwrite"
    with pytest.raises(UpcyclerError, match=appeared), staged_directory(out, overwrite=False) as tmp:
        (tmp / "upcycler.json").write_text("{}")
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == ["theirs.txt"]


HOLD_AND_WAIT = """
import sys, time
from pathlib import Path
from upcycler.io.staging import staged_directory
with staged_directory(Path(sys.argv[1]), overwrite=False) as tmp:
    (tmp / "half.bin").write_bytes(b"half")
    print("holding", flush=True)
    time.sleep(600)
"""


def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path):
    """A writer killed (SIGKILL) while it holds OUT's lock leaves its lock file and its partial: while it
    lived a second writer was refused naming it; once it is dead the next write takes the lock over,
    reclaims the partial and leaves neither behind."""
    from upcycler.errors import UpcyclerError
    from upcycler.io.staging import staged_directory

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_WAIT, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        busy = rf"being written by another upcycler process \(host \S+, pid {holder.pid}, since"
        with pytest.raises(UpcyclerError, match=busy), staged_directory(out, overwrite=True):
            pass
    finally:
        holder.kill()
        holder.wait()
    assert sorted(leftovers(tmp_path, "out")) == sorted([".out.lock", *(p.name for p in tmp_path.glob(".out.partial-*"))])
    with staged_directory(out, overwrite=False) as tmp:
        (tmp / "upcycler.json").write_text("{}")
    assert leftovers(tmp_path, "out") == ["out"]


def test_two_dense_to_moe_runs_into_one_output_one_wins(work):
    """The full CLI, twice: 4 and 8 experts into one OUT at once, neither with --overwrite: one exits 0 and
    OUT is its model, the other exits 2 with one line (naming the writer, or the finished output)."""
    for attempt in range(2):
        out = work / f"out{attempt}"
        procs = {experts: subprocess.Popen([sys.executable, "-m", "upcycler", "dense-to-moe", work / "hf", out,
                                            "--experts", str(experts), "--topk", "2"],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for experts in (4, 8)}
        done = {experts: (proc.wait(timeout=600), proc.stderr.read()) for experts, proc in procs.items()}
        winners = [experts for experts, (status, _) in done.items() if status == 0]
        assert len(winners) == 1, done
        [(status, stderr)] = [v for experts, v in done.items() if experts != winners[0]]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
        assert HOLDER.search(lines[0]) or "already exists; choose another output" in lines[0], lines[0]
        config = json.loads((out / "config.json").read_text())
        assert config["num_local_experts"] == winners[0]
        assert leftovers(work, out.name) == [out.name]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A model large enough that a write is still running when a signal comes, and a copy to merge it with."""
    root = tmp_path_factory.mktemp("big")
    make_tiny("llama", root / "a", hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=8192)
    shutil.copytree(root / "a", root / "b")
    return root


@pytest.mark.parametrize("command", [
    ["convert", "{a}", "{out}", "--shard-size", "1MB"],
    ["dense-to-moe", "{a}", "{out}", "--experts", "4", "--topk", "2"],
    ["merge", "{a}", "{b}", "{out}", "--method", "sma"],
], ids=lambda c: c[0])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "over-an-output"])
def test_sigterm_mid_write_is_one_line_and_leaves_nothing(big, tmp_path, command, existing):
    """SIGTERM (a scheduler's stop) while the output is being staged: exit 143, one line on stderr, no
    `.OUT.partial-*` nor lock left, and OUT absent (or, with --overwrite over an earlier output, untouched)."""
    out = tmp_path / "out"
    argv = [a.format(a=big / "a", b=big / "b", out=out) for a in command]
    if existing:
        shutil.copytree(big / "a", out)
        (out / "upcycler.json").write_text("{}")
        argv.append("--overwrite")
    before = state(out) if existing else None
    proc = subprocess.Popen([sys.executable, "-m", "upcycler", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not list(tmp_path.glob(".out.partial-*/*")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 143, (proc.returncode, stderr)
    assert lines == ["error: terminated (SIGTERM); no output was finished"], stderr
    assert leftovers(tmp_path, "out") == (["out"] if existing else [])
    if existing:
        assert state(out) == before


# --- corrupted sources are caught before the output appears -------------------------------------

def _flip(path: Path, offset: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for k in range(offset, offset + count):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))


def _largest(directory: Path, pattern: str) -> Path:
    return max(directory.rglob(pattern), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("to", ["hf", "orbax"])
def test_flipped_bytes_in_an_orbax_checkpoint_are_caught(work, to):
    chunk = _largest(work / "orbax" / "params", "*")
    _flip(chunk, chunk.stat().st_size // 2)
    before = state(work / "orbax")
    proc = run_cli("convert", work / "orbax", work / "out", "--to", to, check=False)
    fails_cleanly(proc, mentions="differ from the sha256", inputs={work / "orbax": before}, parent=work,
                  out_name="out")


def test_flipped_bytes_in_an_upcycler_hf_output_are_caught_naming_the_shard(work):
    shard = _largest(work / "ours", "*.safetensors")
    _flip(shard, shard.stat().st_size - 200)
    before = state(work / "ours")
    proc = run_cli("dense-to-moe", work / "ours", work / "out", "--experts", "2", "--topk", "2", check=False)
    line = fails_cleanly(proc, mentions="differ from the xxh3_128", inputs={work / "ours": before}, parent=work,
                         out_name="out")
    assert shard.name in line and "tensor lm_head.weight" in line


def test_a_modified_side_file_is_caught(work):
    side = work / "ours" / "generation_config.json"
    assert side.is_file(), "the fixture model has no generation_config.json to modify"
    side.write_text(side.read_text().replace("}", " }", 1))
    proc = run_cli("convert", work / "ours", work / "out", check=False)
    fails_cleanly(proc, mentions="generation_config.json", inputs={}, parent=work, out_name="out")


def test_a_truncated_shard_is_caught_by_its_recorded_size(work):
    shard = _largest(work / "ours", "*.safetensors")
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)
    proc = run_cli("convert", work / "ours", work / "out", check=False)
    fails_cleanly(proc, mentions=shard.name, inputs={}, parent=work, out_name="out")


def test_corruption_in_a_merge_input_is_caught(work):
    chunk = _largest(work / "orbax" / "params", "*")
    _flip(chunk, 4096)
    proc = run_cli("merge", work / "ours", work / "orbax", work / "out", "--method", "sma", check=False)
    fails_cleanly(proc, mentions="differ from the sha256", inputs={}, parent=work, out_name="out")


def test_malformed_digest_records_are_refused(work):
    manifest = work / "ours" / "upcycler.json"
    data = json.loads(manifest.read_text())
    first = next(iter(data["files"]))
    data["files"][first] = {"bytes": "many", "sha256": 7}
    manifest.write_text(json.dumps(data))
    proc = run_cli("convert", work / "ours", work / "out", check=False)
    fails_cleanly(proc, mentions="malformed", inputs={}, parent=work, out_name="out")


def test_clean_sources_with_manifests_still_convert_and_verify(work):
    run_cli("convert", work / "orbax", work / "back")
    run_cli("dense-to-moe", work / "ours", work / "moe", "--experts", "2", "--topk", "2")
    assert (work / "back" / "upcycler.json").is_file() and (work / "moe" / "upcycler.json").is_file()


# --- a full disk ---------------------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path):
    """A 200 KB tmpfs (root only: the CI machine runs as root); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("to", ["hf", "orbax"])
def test_a_full_disk_gives_one_line_and_leaves_nothing(work, tiny_disk, to):
    proc = run_cli("convert", work / "hf", tiny_disk / "out", "--to", to, check=False)
    assert_clean_failure(proc, mentions="disk full")
    assert list(tiny_disk.iterdir()) == []


def test_staged_files_reclaims_dead_writers_inside_and_beside_the_output(tmp_path):
    from upcycler.io.staging import staged_files

    out = tmp_path / "data"
    out.mkdir()
    (out / "web.meta.json").write_text("{}")
    dead, alive = _dead_pid(), os.getpid()
    inside_dead, inside_alive = out / f".partial-{dead}-00000000", out / f".partial-{alive}-11111111"
    beside_dead = tmp_path / f".data.partial-{dead}-22222222"
    for d in (inside_dead, inside_alive, beside_dead):
        d.mkdir()
        (d / "x.tokens.npy").write_bytes(b"\0" * 64)
    with staged_files(out, "--out") as stage:
        (stage / "code.meta.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == sorted(["web.meta.json", "code.meta.json", inside_alive.name])
    assert not beside_dead.exists()


# --- what the system refuses: a name too long, a stdout that cannot be written -----------------------

LONG = "n" * 300  # longer than a file name may be (255 bytes)


@pytest.mark.parametrize("command", [
    ["inspect", "{long}"],
    ["convert", "{hf}", "{long}"],
    ["convert", "{long}", "{out}"],
    ["dense-to-moe", "{hf}", "{long}", "--experts", "4", "--topk", "2"],
    ["depth", "{hf}", "{long}", "--layers", "4"],
    ["merge", "{hf}", "{long}", "{out}", "--method", "sma"],
    ["verify", "{long}", "{hf}"],
], ids=lambda c: "-".join(w for w in c[:3] if not w.startswith("{")))
def test_a_name_too_long_is_one_line_in_every_command(work, command):
    long = work / LONG
    args = [a.format(long=long, hf=work / "hf", out=work / "out") for a in command]
    before = state(work / "hf")
    proc = run_cli(*args, check=False)
    line = fails_cleanly(proc, mentions="File name too long; pass a shorter path", inputs={work / "hf": before},
                         parent=work, out_name="out")
    assert LONG in line and proc.returncode == 2


@pytest.mark.parametrize("command", [["inspect", "{hf}"], ["inspect", "{hf}", "--json"], ["--help"],
                                     ["dense-to-moe", "{hf}", "--experts", "4", "--topk", "2", "--dry-run"]],
                         ids=["inspect", "inspect-json", "help", "dry-run"])
def test_a_stdout_that_cannot_be_written_is_one_line(work, command):
    """`> /dev/full`: the result cannot be written; one line on stderr says so, not a traceback."""
    args = [a.format(hf=work / "hf") for a in command]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "upcycler", *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [("error: stdout: cannot write the result (No space left on device); "
                                         "redirect it to a file on a disk with room")]
