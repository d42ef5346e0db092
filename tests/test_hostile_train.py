"""Hostile input to the trainer side: `prepare-data`, `continued-pretrain` and `report`.

Through the real CLI in a subprocess, each bad input must give a non-zero exit, exactly one `error:` line
naming the file or option, no traceback, no hang (a subprocess timeout), its inputs' bytes and mtimes
unchanged and nothing finished-looking left behind. Then Hypothesis: the training config parser, JSONL
data lines, the metrics log and prepared-source files turn any generated input into a valid object or
one `UpcyclerError`, never another exception.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import trainer_fixtures as F
import yaml
from cli_helpers import assert_clean_failure, leftovers, run_cli
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from upcycler.errors import UpcyclerError
from upcycler.train.config import TrainConfig, load_config
from upcycler.train.data.readers import jsonl_record
from upcycler.train.data.sources import open_source
from upcycler.train.reporting.metrics import parse_metrics_line, read_metrics

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TIMEOUT = 120  # a hang fails the test instead of blocking it

BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
)
GOOD_STEP = {"step": 0, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0,
             "expert_load": [[0.5, 0.5], [0.25, 0.75]]}


@pytest.fixture
def locked(tmp_path):
    """A directory in which nothing can be created (root ignores modes: /sys refuses it even root)."""
    if os.geteuid() == 0:
        yield Path("/sys")
        return
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    yield locked
    locked.chmod(0o700)


def state(*roots: Path) -> dict[str, tuple[bytes, int]]:
    """Bytes and mtime of every regular file under `roots` (FIFOs and devices are not read)."""
    out = {}
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")) if root.is_dir() else []:
            if path.is_file():
                out[str(path)] = (path.read_bytes(), path.stat().st_mtime_ns)
    return out


def refused(*args, mentions: str, inputs: tuple[Path, ...] = (), out: Path | None = None) -> str:
    """`upcycle ARGS` fails cleanly, leaves `inputs` untouched and nothing at (or beside) `out`."""
    before = state(*inputs)
    proc = run_cli(*args, check=False, timeout=TIMEOUT)
    line = assert_clean_failure(proc, mentions=mentions)
    assert state(*inputs) == before, "an input was modified"
    if out is not None:
        assert leftovers(out.parent, out.name) == [], "an output was left behind"
    return line


def run_many(commands: list[list]) -> list[subprocess.CompletedProcess]:
    """Several slow CLI runs (the trainer imports JAX) side by side."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        return list(pool.map(lambda args: run_cli(*args, check=False, timeout=TIMEOUT), commands))


# --- prepare-data ---------------------------------------------------------------------------------

def prepare(ws, tmp_path, *sources: str, out: Path | None = None, extra: tuple = ()):
    out = out or tmp_path / "out"
    args = ["prepare-data", "--tokenizer", ws["tokenizer"], "--out", out, *extra]
    for source in sources:
        args += ["--source", source]
    return args, out


GOOD_LINE = b'{"text": "def f(x): return x"}\n'
BAD_LINES = {
    "deep nesting": b"[" * 100_000,
    "5000-digit number": b'{"text": "a", "n": ' + b"9" * 5000 + b"}",
    "NaN literal": b'{"text": "a", "x": NaN}',
    "a list, not an object": b'["text", "a"]',
    "not UTF-8": b'{"text": "\xff\xfe"}',
    "text not a string": b'{"text": {"a": 1}}',
    "torn object": b'{"text": "a',
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_jsonl_line_is_fatal_naming_file_and_line(ws, tmp_path, case):
    (tmp_path / "in").mkdir()
    data = tmp_path / "in" / "bad.jsonl"
    data.write_bytes(GOOD_LINE + BAD_LINES[case] + b"\n" + GOOD_LINE)
    args, out = prepare(ws, tmp_path, f"s={data}")
    refused(*args, mentions="bad.jsonl:2", inputs=(tmp_path / "in",), out=out)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_source_that_is_not_a_regular_file_is_refused_without_blocking(ws, tmp_path, kind):
    target = tmp_path / "in.jsonl"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    else:
        target = Path("/dev/zero")
    args, out = prepare(ws, tmp_path, f"s={target}", extra=("--format", "jsonl"))
    refused(*args, mentions=str(target), out=out)


def test_fifo_matched_by_a_glob_is_refused(ws, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(GOOD_LINE)
    os.mkfifo(tmp_path / "in" / "b.jsonl")
    args, out = prepare(ws, tmp_path, f"s={tmp_path}/in/*.jsonl")
    refused(*args, mentions="b.jsonl: not a regular file", out=out)


def test_corrupt_gzip_is_refused(ws, tmp_path):
    import gzip

    data = bytearray(gzip.compress(GOOD_LINE * 200))
    data[20:40] = b"\xff" * 20
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "c.jsonl.gz").write_bytes(bytes(data))
    args, out = prepare(ws, tmp_path, f"s={tmp_path}/in/c.jsonl.gz")
    refused(*args, mentions="c.jsonl.gz", inputs=(tmp_path / "in",), out=out)


def test_out_under_a_read_only_directory_is_refused(ws, tmp_path, locked):
    (tmp_path / "a.jsonl").write_bytes(GOOD_LINE)
    args, _out = prepare(ws, tmp_path, f"s={tmp_path}/a.jsonl", out=locked / "upcycler-out")
    refused(*args, mentions="--out", inputs=(tmp_path / "a.jsonl",))
    assert not (locked / "upcycler-out").exists()


def test_out_that_is_a_file_is_refused(ws, tmp_path):
    (tmp_path / "a.jsonl").write_bytes(GOOD_LINE)
    (tmp_path / "out").write_text("mine")
    args, _out = prepare(ws, tmp_path, f"s={tmp_path}/a.jsonl")
    refused(*args, mentions="not a directory", inputs=(tmp_path / "out", tmp_path / "a.jsonl"))


def test_an_input_that_would_be_overwritten_is_refused(ws, tmp_path):
    (tmp_path / "a.jsonl").write_bytes(GOOD_LINE)
    args, out = prepare(ws, tmp_path, f"s={tmp_path}/a.jsonl")
    run_cli(*args)
    args, _ = prepare(ws, tmp_path, f"s={out}/s.index.json", extra=("--overwrite",))
    refused(*args, mentions="would be overwritten", inputs=(out,))


def test_failed_overwrite_keeps_the_prepared_sources_and_adds_nothing(ws, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(GOOD_LINE * 3)
    (tmp_path / "in" / "bad.jsonl").write_bytes(GOOD_LINE + b"{oops}\n")
    args, out = prepare(ws, tmp_path, f"a={tmp_path}/in/a.jsonl")
    run_cli(*args)
    args, _ = prepare(ws, tmp_path, f"a={tmp_path}/in/a.jsonl", f"b={tmp_path}/in/bad.jsonl",
                      extra=("--overwrite",))
    refused(*args, mentions="bad.jsonl:2", inputs=(out, tmp_path / "in"))
    assert sorted(p.name for p in out.iterdir()) == ["a.index.json", "a.shards"]


def test_a_failure_in_a_later_source_leaves_no_output(ws, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(GOOD_LINE * 3)
    (tmp_path / "in" / "z.jsonl").write_bytes(GOOD_LINE + b'{"body": 1}\n')
    args, _out = prepare(ws, tmp_path, f"a={tmp_path}/in/a.jsonl", f"z={tmp_path}/in/z.jsonl",
                        out=tmp_path / "new" / "nested" / "out")
    refused(*args, mentions="z.jsonl:2", inputs=(tmp_path / "in",))
    assert not (tmp_path / "new").exists(), "a parent directory created for the output was left behind"


@pytest.mark.parametrize("case", ["binary", "fifo", "nested tokenizer_config.json", "huge --eos id"])
def test_bad_tokenizer_inputs_are_refused(ws, tmp_path, case):
    tok = tmp_path / "tok"
    tok.mkdir()
    extra = ()
    mentions = "tokenizer.json"
    if case == "binary":
        (tok / "tokenizer.json").write_bytes(bytes(range(256)) * 4)
    elif case == "fifo":
        os.mkfifo(tok / "tokenizer.json")
    else:
        shutil.copy(ws["tokenizer"], tok / "tokenizer.json")
        if case == "huge --eos id":
            extra, mentions = ("--eos", "9" * 5000), "--eos"
        else:
            (tok / "tokenizer_config.json").write_text("[" * 100_000)
            mentions = "tokenizer_config.json"
    (tmp_path / "a.jsonl").write_bytes(GOOD_LINE)
    out = tmp_path / "out"
    args = ["prepare-data", "--tokenizer", tok, "--source", f"s={tmp_path}/a.jsonl", "--out", out, *extra]
    refused(*args, mentions=mentions, inputs=(tok, tmp_path / "a.jsonl"), out=out)


ENGINE_OPTIONS = {  # what Beam would not run as given: refused before OUT or its work directory is made
    "a value Beam refuses": (("--workers", "2", "--beam-option", "direct_running_mode=bogus"),
                             "'direct_running_mode=bogus': invalid choice: 'bogus' (choose from 'in_memory',"),
    "an option Beam does not know": (("--beam-option", "direct_num_wrokers=4"),
                                     "not an option Apache Beam knows; did you mean direct_num_workers?"),
    "a runner Beam does not have": (("--runner", "NoSuchRunner"),
                                    "--runner 'NoSuchRunner': not a runner Apache Beam can create; use one of"),
    "a runner that fails before any work": (("--runner", "DataflowRunner"), "DataflowRunner"),
    "an expansion ratio below 1": (("--max-expansion", "0.5"), "--max-expansion: the ratio must be at least 1"),
    "an expansion ratio that is not a number": (("--max-expansion", "nan"), "--max-expansion"),
}


@pytest.mark.parametrize("case", list(ENGINE_OPTIONS))
def test_engine_options_beam_would_not_run_are_refused_leaving_nothing(ws, tmp_path, case):
    (tmp_path / "a.jsonl").write_bytes(GOOD_LINE)
    extra, mentions = ENGINE_OPTIONS[case]
    args, out = prepare(ws, tmp_path, f"s={tmp_path}/a.jsonl", extra=extra)
    refused(*args, mentions=mentions, inputs=(tmp_path / "a.jsonl",), out=out)


def _bomb(path: Path, total: int) -> Path:
    """`total` bytes of one JSONL line repeated, compressed as `path`'s suffix says (a few kB on disk)."""
    import gzip

    import zstandard

    block = b'{"text": "' + b"a" * 1000 + b'"}\n'
    block *= (1 << 20) // len(block)
    with open(path, "wb") as raw:
        out = (gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9) if path.suffix == ".gz"
               else zstandard.ZstdCompressor().stream_writer(raw))
        for _ in range(total // len(block)):
            out.write(block)
        out.close()
    return path


@pytest.mark.parametrize("name", ["bomb.jsonl.gz", "bomb.jsonl.zst"])
def test_a_compression_bomb_is_refused_within_seconds(ws, tmp_path, name):
    """Repeated JSONL at deflate's limit (~1,000x) or beyond (zstd): refused after its first few MiB, naming
    the file, the ratio and the option that admits a trusted file, nothing written."""
    (tmp_path / "in").mkdir()
    bomb = _bomb(tmp_path / "in" / name, 64 << 20)  # refused after 4 MiB of it, whatever its size
    args, out = prepare(ws, tmp_path, f"s={bomb}")
    began = time.monotonic()
    line = refused(*args, mentions=f"{name}: expands", inputs=(tmp_path / "in",), out=out)
    assert time.monotonic() - began < 30 and "(more than --max-expansion 100;" in line and "pass --max-expansion" in line


def test_a_trusted_file_expands_past_the_limit_and_the_disk_it_needs_is_said_first(ws, tmp_path):
    (tmp_path / "in").mkdir()
    dense = _bomb(tmp_path / "in" / "dense.jsonl.gz", 5 << 20)  # just past the 4 MiB always allowed
    args, out = prepare(ws, tmp_path, f"s={dense}")
    refused(*args, mentions="dense.jsonl.gz: expands", inputs=(tmp_path / "in",), out=out)
    done = run_cli(*args, "--max-expansion", "100000", timeout=TIMEOUT)
    first, summary = done.stdout.splitlines()
    assert "(5.24 MB of text)" in first and "the output needs about" in first and "free at" in first, first
    assert summary.startswith("s: ") and (out / "s.index.json").is_file()


def test_overwrite_without_a_split_removes_the_split_it_replaces_and_keeps_a_source_of_that_name(ws, tmp_path):
    """NAME prepared with --heldout, then again with --overwrite and no split: NAME.heldout goes with the old
    NAME. A source prepared in its own right under a .heldout name (no `split` in its index) stays."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"document number {k}"}) + "\n" for k in range(40)))
    args, out = prepare(ws, tmp_path, f"s={tmp_path}/a.jsonl", extra=("--heldout", "0.5"))
    run_cli(*args, timeout=TIMEOUT)
    args, _ = prepare(ws, tmp_path, f"t.heldout={tmp_path}/a.jsonl")
    run_cli(*args, timeout=TIMEOUT)  # a source of its own, named like t's split
    args, _ = prepare(ws, tmp_path, f"s={tmp_path}/a.jsonl", f"t={tmp_path}/a.jsonl", extra=("--overwrite",))
    run_cli(*args, timeout=TIMEOUT)
    assert sorted(p.name for p in out.iterdir()) == ["s.index.json", "s.shards", "t.heldout.index.json",
                                                     "t.heldout.shards", "t.index.json", "t.shards"]


# --- continued-pretrain: the config -----------------------------------------------------------------

def train_args(path: Path, *extra) -> list:
    return ["continued-pretrain", "--config", path, *extra]


def good_config(ws, tmp_path) -> Path:
    return F.write_config(tmp_path / "train.yaml", F.config_dict(tmp_path, ws["dense"], ws["data"]))



def test_a_step_larger_than_this_host_is_refused_before_allocating(ws, tmp_path):
    """A batch whose compiled step needs far more memory than any test host has (about 0.5 TB of
    activations): one line naming the config, the compiled figure per device and the fix, before a
    parameter is read or the run directory made (the step is compiled from shapes alone)."""
    path = good_config(ws, tmp_path)
    started = time.monotonic()
    line = refused(*train_args(path, "--set", "data.global_batch_size=1048576", "--set", "data.seq_len=256"),
                   mentions="train.yaml: the train step of 1048576 rows × 256 tokens needs", inputs=(path,),
                   out=tmp_path / "run")
    assert "per device (compiled" in line and "available" in line and "data.microbatches" in line, line
    assert time.monotonic() - started < TIMEOUT


def test_a_step_the_accelerators_compiler_refuses_is_the_same_one_line(ws, tmp_path):
    """On a TPU the compiler itself refuses a step that cannot fit (RESOURCE_EXHAUSTED): the memory check
    turns that into its one line with the compiler's words, not a traceback."""
    import jax

    from upcycler.train.loop import memory_check, run_build
    from upcycler.train.loop.memory_check import StepTooLarge

    config = load_config(good_config(ws, tmp_path))
    built = run_build.build(config, F.tiny_spec())

    class RefusingCompiler:
        def compile(self, state, batch, clock=None):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used "
                                             "20.5G of 15.75G hbm. Exceeded hbm capacity by 4.75G.\nmore detail")

    with pytest.raises(StepTooLarge) as refused:
        memory_check.check_step_memory(config, built, RefusingCompiler(), 0)
    line = str(refused.value)
    assert "\n" not in line and "the compiler ran out of memory" in line and "Used 20.5G of 15.75G" in line, line
    assert "data.microbatches" in line


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_the_peak_is_the_accelerators_own_and_the_cpus_buffers_summed(platform):
    """The compiler's memory figures of the reference MoE's step compiled for v5e (temporaries that are
    never live together sum past the peak; the compiler compiled it for a 15.75 GiB chip, so its peak of
    12.5 GB is the figure) are taken as they are on a TPU. The same figures from the CPU compiler, whose
    peak leaves the temporaries out, are summed."""
    from types import SimpleNamespace

    from upcycler.train.loop.memory_check import compiled_peak

    stats = SimpleNamespace(argument_size_in_bytes=630_818_816, output_size_in_bytes=630_660_096,
                            alias_size_in_bytes=630_621_696, temp_size_in_bytes=16_319_407_104,
                            generated_code_size_in_bytes=93_374_976, peak_memory_in_bytes=12_515_450_368)
    device = SimpleNamespace(platform=platform)
    compiled = SimpleNamespace(memory_analysis=lambda: stats,
                               input_shardings=((SimpleNamespace(device_set=[device]),), {}))
    summed = 630_818_816 + 630_660_096 - 630_621_696 + 16_319_407_104 + 93_374_976
    assert compiled_peak(compiled) == (12_515_450_368 if platform == "tpu" else summed)


def test_binary_config_is_refused(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_bytes(bytes(range(256)) * 8)
    refused(*train_args(path), mentions="train.yaml", inputs=(path,), out=tmp_path / "run")


def test_alias_bomb_is_refused_quickly(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB + "\nsteps: *i\n")
    line = refused(*train_args(path), mentions="bomb.yaml", inputs=(path,))
    assert len(line) < 300


def test_small_alias_expansion_in_an_option_is_described_briefly(ws, tmp_path):
    path = good_config(ws, tmp_path)
    text = path.read_text().replace("run_dir: ", "run_dir: &r ", 1)
    path.write_text(text.replace("steps: 6", f"steps: [{', '.join(['*r'] * 9)}]", 1))
    line = refused(*train_args(path), mentions="steps", inputs=(path,), out=tmp_path / "run")
    assert "<list of 9>" in line and len(line) < 300


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "yaml list", "yaml scalar", "empty"])
def test_config_that_is_not_a_mapping_file_is_refused(tmp_path, kind):
    path = tmp_path / "train.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path.write_text({"yaml list": "- a\n- b\n", "yaml scalar": "42\n", "empty": ""}[kind])
    refused(*train_args(path), mentions=str(path), out=tmp_path / "run")


BAD_OPTIONS = {
    "unclosed --set": (["--set", "steps=[unclosed"], "--set steps"),
    "a control character in --set": (["--set", "steps=\x1f"], "--set steps"),
    "lr NaN": (["--set", "optimizer.lr=.nan"], "optimizer.lr"),
    "lr nan as text": (["--set", "optimizer.lr=nan"], "optimizer.lr"),
    "b1 infinite": (["--set", "optimizer.b1=.inf"], "optimizer.b1"),
    "b2 at 1": (["--set", "optimizer.b2=1"], "optimizer.b2"),
    "peak flops inf": (["--peak-flops", "inf"], "metrics.peak_flops"),
    "huge float": (["--set", "optimizer.eps=1e999"], "optimizer.eps"),
    "steps a bool": (["--set", "steps=true"], "steps"),
    "steps huge": (["--steps", "9" * 30], "steps"),
    "steps 5000 digits": (["--set", "steps=" + "9" * 5000], "--set steps"),
    "seq_len a float": (["--set", "data.seq_len=1.5"], "seq_len"),
    "seq_len beyond range": (["--set", "data.seq_len=99999999999"], "seq_len"),
    "process id beyond processes": (["--num-processes", "2", "--process-id", "5"], "process_id"),
    "weight infinite": (["--set", "data.phases=[{weights: {json: .inf}}]"], "weights.json"),
    "weight huge integer": (["--set", "data.phases=[{weights: {json: " + "9" * 400 + "}}]"], "weights.json"),
    "source name escapes the data dir": (["--set", "data.phases=[{weights: {../../x: 1.0}}]"], "source name"),
    "data.dir not a path": (["--set", "data.dir=[1, 2]"], "dir"),
    "run_dir with a NUL": (["--set", 'run_dir="a\\0b"'], "run_dir"),
    "a section that is a list": (["--set", "optimizer=[1]"], "optimizer"),
    "setting inside a list": (["--set", "data.phases.0=1"], "data.phases.0"),
    "until_step a float": (["--set", "optimizer.schedule=[{kind: warmup, until_step: 2.5}]"], "until_step"),
    "mapping key a huge integer": (["--set", "model={" + "9" * 400 + ": 1}"], "model"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_option_values_are_refused_before_training(ws, tmp_path, case):
    extra, mentions = BAD_OPTIONS[case]
    path = good_config(ws, tmp_path)
    refused(*train_args(path, *extra), mentions=mentions, inputs=(path,), out=tmp_path / "run")


MORE_BAD_SETS = {  # the same validators, in-process (each CLI run costs a second)
    "--set without =": ("steps", "--set"),
    "lb_coef -inf": ("loss.lb_coef=-.inf", "loss.lb_coef"),
    "checkpoint.every a string": ("checkpoint.every='3'", "checkpoint.every"),
    "checkpoint.keep zero": ("checkpoint.keep=0", "checkpoint.keep"),
    "checkpoint.async a number": ("checkpoint.async=1", "checkpoint.async"),
    "mesh size huge": ("mesh.fsdp=1000000000000000000000", "mesh.fsdp"),
    "two -1 mesh sizes": ("mesh={data: -1, fsdp: -1}", "mesh sizes"),
    "negative seed": ("data.seed=-1", "seed"),
    "prefetch huge": ("data.prefetch=100000", "prefetch"),
    "shuffle a string": ("data.shuffle=yes please", "shuffle"),
    "phases empty": ("data.phases=[]", "phases is empty"),
    "phases a mapping": ("data.phases={a: 1}", "phases must be a list"),
    "sources twice": ("data.sources=[json, json]", "twice"),
    "weights sum above 1": ("data.phases=[{weights: {json: 0.9, email: 0.2}}]", "sum to 1.1"),
    "weight a bool": ("data.phases=[{weights: {json: true}}]", "weights.json"),
    "schedule lr negative": ("optimizer.schedule=[{kind: cosine, until_step: 5, lr: -1}]", "schedule[0].lr"),
    "schedule a mapping": ("optimizer.schedule={kind: warmup}", "optimizer.schedule"),
    "schedule kind a list": ("optimizer.schedule=[{kind: [a], until_step: 5}]", "kind"),
    "until_step beyond int32": ("optimizer.schedule=[{kind: warmup, until_step: 3000000000}]", "until_step"),
    "coordinator without a port": ("distributed.coordinator=localhost", "host:port"),
    "num_processes zero": ("distributed.num_processes=0", "num_processes"),
    "expert_load_every a float": ("metrics.expert_load_every=2.0", "expert_load_every"),
    "peak_flops zero": ("metrics.peak_flops=0", "peak_flops"),
    "writer unknown": ("metrics.writers=[jsonl, mlflow]", "metrics.writers names 'mlflow'"),
    "writer twice": ("metrics.writers=[jsonl, tensorboard, tensorboard]", "twice"),
    "writers without jsonl": ("metrics.writers=[tensorboard]", "must include jsonl"),
    "writers a string": ("metrics.writers=tensorboard", "metrics.writers"),
    "wandb mode unknown": ("metrics.wandb={mode: sometimes}", "mode"),
    "profile after the run": ("profile={start_step: 1000000}", "profile.start_step"),
    "profile without a start": ("profile={steps: 2}", "start_step"),
    "eval every zero": ("eval={every: 0}", "eval.every"),
    "eval sources empty": ("eval={sources: []}", "eval.sources is empty"),
    "eval source a path": ("eval={sources: [../web]}", "eval.sources"),
    "compute dtype unknown": ("model.compute_dtype=float8", "compute_dtype"),
    "remat a string": ("model.remat=maybe", "model.remat"),
    "tokenizer a number": ("model.tokenizer=5", "model.tokenizer"),
    "data a list": ("data=[1]", "data"),
    "unknown top-level key": ("stepz=5", "'stepz'"),
    "control characters in a value": ('model.attention="\\x1b[31mred"', "model.attention"),
}


@pytest.mark.parametrize("case", list(MORE_BAD_SETS))
def test_more_bad_values_are_one_error_naming_the_option(ws, tmp_path, case):
    item, mentions = MORE_BAD_SETS[case]
    with pytest.raises(UpcyclerError) as caught:
        load_config(good_config(ws, tmp_path), sets=[item])
    message = str(caught.value)
    assert mentions in message and "\n" not in message and "\x1b" not in message, message


def test_run_dir_that_overlaps_the_checkpoint_or_the_data_is_refused(ws, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(ws["dense"])
    cases = {
        "inside model.init": (ws["dense"] / "run", "lies inside model.init"),
        "model.init, through a symlink": (link, "is model.init"),
        "contains model.init and data": (ws["root"], "contains model.init"),
        "data.dir": (ws["data"], "is data.dir"),
    }
    path = good_config(ws, tmp_path)
    before = state(path, ws["dense"], ws["data"])
    procs = run_many([train_args(path, "--run-dir", run_dir) for run_dir, _ in cases.values()])
    for (case, (run_dir, mentions)), proc in zip(cases.items(), procs):
        assert_clean_failure(proc, mentions=mentions)
        assert "run_dir" in proc.stderr, case
    assert state(path, ws["dense"], ws["data"]) == before
    assert not (ws["dense"] / "run").exists()


# --- continued-pretrain: a hostile data directory ------------------------------------------------------

def _meta(d: Path, **changes) -> None:
    meta = json.loads((d / "json.meta.json").read_text())
    meta.update(changes)
    (d / "json.meta.json").write_text(json.dumps(meta))


def _tokens(d: Path) -> np.ndarray:
    return np.load(d / "json.tokens.npy")


def _replace_tokens(d: Path, array: np.ndarray, **kwargs) -> None:
    np.save(d / "json.tokens.npy", array, **kwargs)


DATA_DIRS = {
    "tokens file is an .npz": (
        lambda d: np.savez(d / "t.npz", a=_tokens(d)) or os.replace(d / "t.npz", d / "json.tokens.npy"),
        "json.tokens.npy"),
    "meta is a list": (lambda d: (d / "json.meta.json").write_text("[1, 2]"), "json.meta.json"),
    "meta num_tokens a string": (lambda d: _meta(d, num_tokens="many"), "num_tokens"),
    "meta vocab_size a bool": (lambda d: _meta(d, vocab_size=True), "vocab_size"),
    "meta eos_id huge": (lambda d: _meta(d, eos_id=10**30), "eos_id"),
    "meta nested deeply": (lambda d: (d / "json.meta.json").write_text("[" * 100_000), "json.meta.json"),
    "truncated tokens": (
        lambda d: (d / "json.tokens.npy").write_bytes((d / "json.tokens.npy").read_bytes()[:1000]),
        "truncated"),
    "wrong dtype": (lambda d: _replace_tokens(d, _tokens(d).astype(np.int64)), "json.tokens.npy"),
    "pickled object array": (
        lambda d: _replace_tokens(d, np.array([{"x": 1}] * _tokens(d).size, dtype=object), allow_pickle=True),
        "json.tokens.npy"),
    "tokens file is a FIFO": (
        lambda d: ((d / "json.tokens.npy").unlink(), os.mkfifo(d / "json.tokens.npy")), "json.tokens.npy"),
}


def _index(d: Path, **changes) -> None:
    index = json.loads((d / "json.index.json").read_text())
    index.update(changes)
    (d / "json.index.json").write_text(json.dumps(index))


def _shard(d: Path, source: str = "json") -> Path:
    return d / json.loads((d / f"{source}.index.json").read_text())["shards"][0]["file"]


SHARDED_DATA_DIRS = {
    "index is a list": (lambda d: (d / "json.index.json").write_text("[1, 2]"), "json.index.json"),
    "index num_tokens off by one": (
        lambda d: _index(d, num_tokens=json.loads((d / "json.index.json").read_text())["num_tokens"] + 1),
        "num_tokens"),
    "shard named outside the directory": (
        lambda d: _index(d, shards=[{**json.loads((d / "json.index.json").read_text())["shards"][0],
                                     "file": "../json.shards/00000.tokens"}]), "not a shard"),
    "shard truncated": (lambda d: _shard(d).write_bytes(_shard(d).read_bytes()[:1000]), "truncated"),
    "shard swapped with another source's": (lambda d: shutil.copyfile(_shard(d, "email"), _shard(d)),
                                            "does not match"),
    "shard missing": (lambda d: _shard(d).unlink(), "missing"),
    "shard is a FIFO": (lambda d: (_shard(d).unlink(), os.mkfifo(_shard(d))), "not a regular file"),
}


def test_hostile_data_directories_are_refused(ws, tmp_path):
    """Damaged sharded sources, and damaged sources in the single-file format of earlier versions."""
    cases = []
    damages = {**SHARDED_DATA_DIRS, **{f"single file: {k}": v for k, v in DATA_DIRS.items()}}
    for k, (case, (damage, mentions)) in enumerate(damages.items()):
        data = tmp_path / f"data{k}"
        shutil.copytree(ws["data"], data)
        if case.startswith("single file"):
            F.as_single_file(data)
        damage(data)
        cfg = F.write_config(tmp_path / f"train{k}.yaml",
                             F.config_dict(tmp_path / f"r{k}", ws["dense"], data))
        cases.append((data, cfg, mentions))
    before = state(tmp_path, ws["dense"])
    procs = run_many([train_args(cfg) for _, cfg, _ in cases])
    for case, (data, _, mentions), proc in zip(damages, cases, procs):
        try:
            assert_clean_failure(proc, mentions=mentions)
        except AssertionError as err:
            raise AssertionError(f"{case}: {err}") from None
    assert state(tmp_path, ws["dense"]) == before
    assert not any((tmp_path / f"r{k}").exists() for k in range(len(cases)))


# --- report -------------------------------------------------------------------------------------------

def metrics_run(tmp_path: Path, lines: list[bytes]) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    return run


def line(**changes) -> bytes:
    return json.dumps({**GOOD_STEP, **changes}).encode() + b"\n"


BAD_METRICS = {
    "a line that is a list": [line(), b"[1, 2]\n", line(step=2)],
    "a non-numeric loss": [line(), line(step=1, loss="abc")],
    "a boolean step": [line(), line(step=True)],
    "no step": [line(), b'{"loss": 1.0}\n'],
    "a NaN literal": [line(), b'{"step": 1, "loss": NaN}\n'],
    "ragged expert_load rows": [line(), line(step=1, expert_load=[[0.5, 0.5], [1.0]])],
    "expert_load changes shape": [line(), line(step=1, expert_load=[[0.3, 0.3, 0.4], [1, 0, 0]])],
    "expert_load not a list": [line(), line(step=1, expert_load="lots")],
    "garbage in the middle": [line(), b"{oops\n", line(step=2)],
    "deep nesting": [line(), b"[" * 100_000 + b"\n"],
}


@pytest.mark.parametrize("case", list(BAD_METRICS))
def test_bad_metrics_line_fails_naming_file_and_line(tmp_path, case):
    run = metrics_run(tmp_path, BAD_METRICS[case])
    refused("report", run, mentions="metrics.jsonl:2", inputs=(run,), out=run / "report")


def test_binary_metrics_file_is_refused(tmp_path):
    run = metrics_run(tmp_path, [bytes(range(256)) * 4])
    refused("report", run, mentions="metrics.jsonl:1", inputs=(run,), out=run / "report")


def test_metrics_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "metrics.jsonl")
    refused("report", tmp_path / "run", mentions="not a regular file", out=tmp_path / "run" / "report")


def test_torn_last_line_of_a_killed_run_is_ignored(tmp_path):
    run = metrics_run(tmp_path, [line(), line(step=1), b'{"step": 2, "loss": 4.'])
    proc = run_cli("report", run)
    assert "Traceback" not in proc.stderr
    names = sorted(p.name for p in (run / "report").iterdir())
    assert names == ["expert_load_layer0.png", "expert_load_layer1.png", "loss.png", "training.png"]


def test_report_out_under_a_read_only_directory_is_refused(tmp_path, locked):
    run = metrics_run(tmp_path, [line(), line(step=1)])
    refused("report", run, "--out", locked / "upcycler-report", mentions="--out", inputs=(run,))
    assert not (locked / "upcycler-report").exists()


def test_a_failure_while_drawing_leaves_no_partial_set(tmp_path):
    """The third PNG fails (a full disk): neither a new report nor a change to an existing one."""
    run = metrics_run(tmp_path, [line(), line(step=1)])
    old = tmp_path / "old"
    old.mkdir()
    (old / "loss.png").write_bytes(b"previous")
    script = (
        "import errno, sys\n"
        "import matplotlib.figure as mf\n"
        "real, calls = mf.Figure.savefig, []\n"
        "def savefig(self, *args, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3: raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    return real(self, *args, **kwargs)\n"
        "mf.Figure.savefig = savefig\n"
        "from upcycler.cli import main\n"
        "sys.argv = ['upcycle', 'report', sys.argv[1], '--out', sys.argv[2]]\n"
        "main()\n"
    )
    for out in (tmp_path / "new", old):
        before = state(run, old)
        proc = subprocess.run([sys.executable, "-c", script, str(run), str(out)],
                              capture_output=True, text=True, timeout=TIMEOUT, check=False)
        assert_clean_failure(proc, mentions="No space left")
        assert state(run, old) == before
        assert leftovers(tmp_path, "new") == [] and [p.name for p in old.iterdir()] == ["loss.png"]


# --- Hypothesis: the parsers ----------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(300, 4000).map(lambda n: 10**n)
    | st.floats(allow_nan=True)
    | st.text(max_size=12) | st.sampled_from(["../x", "", "a\0b", "nan", "1e999", "3e-4", "json"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(), inner,
                                                                 max_size=4),
    max_leaves=12,
)


def _valid_config() -> dict:
    root = Path(tempfile.gettempdir())
    return F.config_dict(root, root / "init", root / "data")


def _paths(value, prefix=()):
    """Every (path of keys/indices) inside a nested config, the root included."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _paths(child, (*prefix, i))


VALID_PATHS = [p for p in _paths(_valid_config()) if p]


def _mutate(config: dict, path: tuple, action: str, value) -> None:
    """Apply one mutation; one whose section an earlier mutation replaced or deleted has nothing to act on."""
    *parents, last = path
    node = config
    for key in parents:
        if not isinstance(node, dict) or key not in node:
            return
        node = node[key]
    if not isinstance(node, dict):
        return
    if action == "delete":
        node.pop(last, None)
    elif action == "extra key" and isinstance(node, dict):
        node[f"unknown_{last}"] = value
    else:
        node[last] = value


def _parse_or_refuse(parse):
    try:
        return parse()
    except UpcyclerError as err:
        assert "\n" not in str(err) and len(str(err)) < 1000, str(err)
        return None


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(VALID_PATHS), st.sampled_from(["set", "delete", "extra key"]),
                          json_values), min_size=1, max_size=3))
@example([(("checkpoint",), "set", None), (("checkpoint", "every"), "delete", None)])  # parent replaced first
def test_mutated_config_is_a_config_or_one_error(mutations):
    config = _valid_config()
    for path, action, value in mutations:
        _mutate(config, path, action, value)
    result = _parse_or_refuse(lambda: TrainConfig.from_dict(copy.deepcopy(config), "train.yaml"))
    if result is not None:
        assert TrainConfig.from_dict(result.to_dict()) == result


YAML_TOKENS = ["steps", "run_dir", "model", "data", "init", "optimizer", "lr", ":", ": ", " ", "\n", "\n  ",
               "- ", "[", "]", "{", "}", ",", "&a ", "*a", "!!python/object:os.system ", "!!binary ", ".nan",
               ".inf", "-.inf", "1e999", "9" * 5000, "true", "null", "'", '"', "\0", "#", "|", ">", "? ",
               "\t", "~", "0x1F", "1_000", "2001-01-01", "<<: *a"]


@FUZZ
@given(st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join)
       | st.tuples(st.integers(0, 2000), st.text(max_size=8), st.integers(0, 8)))
def test_yamlish_document_is_a_config_or_one_error(document):
    text = yaml.safe_dump(_valid_config(), sort_keys=False)
    if isinstance(document, tuple):  # a valid config with a few characters replaced
        at, insert, cut = document
        at %= len(text)
        document = text[:at] + insert + text[at + cut:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.yaml"
        path.write_text(document, encoding="utf-8", errors="surrogatepass")
        _parse_or_refuse(lambda: load_config(path, sets=["optimizer.lr=1e-4"]))


@FUZZ
@given(st.binary(max_size=200)
       | json_values.map(lambda v: json.dumps(v).encode())
       | st.dictionaries(st.just("text"), json_values, min_size=1).map(lambda v: json.dumps(v).encode())
       | st.integers(1, 200_000).map(lambda n: b"[" * n))
def test_jsonl_line_is_documents_or_one_error(data):
    documents = _parse_or_refuse(lambda: list(jsonl_record(data, "a.jsonl:1", "text")))
    assert documents is None or all(isinstance(d, str) for d in documents)


metrics_lines = (
    st.binary(max_size=120)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.fixed_dictionaries({"step": json_values | st.integers(0, 10)},
                            optional={k: json_values for k in ("loss", "lr", "loss/web", "expert_load")})
    .map(lambda v: json.dumps(v).encode())
)


@FUZZ
@given(st.lists(metrics_lines, max_size=6), st.booleans())
def test_metrics_log_is_records_or_one_error(lines, final_newline):
    _parse_or_refuse(lambda: [parse_metrics_line(x, "metrics.jsonl:1") for x in lines])
    with tempfile.TemporaryDirectory() as tmp:
        text = b"\n".join(x.replace(b"\n", b" ") for x in lines) + (b"\n" if final_newline else b"")
        (Path(tmp) / "metrics.jsonl").write_bytes(text)
        records = _parse_or_refuse(lambda: read_metrics(Path(tmp)))
    for record in records or []:
        assert isinstance(record, dict) and isinstance(record["step"], int)


@pytest.fixture(scope="module")
def prepared_source(ws, tmp_path_factory) -> Path:
    """A single-file source (the format of earlier versions), whose two files the fuzz test edits."""
    copy = tmp_path_factory.mktemp("single") / "data"
    shutil.copytree(ws["data"], copy)
    return F.as_single_file(copy)


@FUZZ
@given(st.dictionaries(st.sampled_from(["format_version", "dtype", "num_tokens", "vocab_size", "eos_id",
                                        "tokenizer"]), json_values, max_size=3),
       st.tuples(st.integers(0, 200), st.binary(max_size=8), st.integers(0, 300)))
def test_prepared_source_is_tokens_or_one_error(prepared_source, meta_changes, token_edit):
    meta = json.loads((prepared_source / "json.meta.json").read_text())
    tokens = (prepared_source / "json.tokens.npy").read_bytes()
    at, insert, cut = token_edit
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "json.meta.json").write_text(json.dumps({**meta, **meta_changes}))
        (directory / "json.tokens.npy").write_bytes(tokens[:at] + insert + tokens[at + cut:])
        source = _parse_or_refuse(lambda: open_source(directory, "json"))
        if source is not None:
            assert source.tokens.shape == (source.meta["num_tokens"],) and source.tokens.dtype.kind == "u"
            del source
