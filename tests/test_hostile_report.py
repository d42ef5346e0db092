"""Hostile input to `upcycle report` (the metrics records added since the last sweep: expert_load_by_source
with its `sources`, expert_health, loss/<source>) and to `upcycle convert --weights ema`.

Most cases run in-process (`CliRunner`): a non-zero exit through `SystemExit` (never another exception),
exactly one `error:` line on stderr naming the file (and the line, for a metrics line) and the thing,
the inputs' bytes unchanged and no report (nor its staging directory) left behind, within `SECONDS`.
One case runs as a real subprocess (a 100 MB line: refused within a memory bound, never read whole).
Then Hypothesis: the per-source and expert-health record parsers turn any input into records or one
`UpcyclerError`, never another exception.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cli_helpers import assert_clean_failure, snapshot
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.train.reporting.metrics import parse_metrics_line, read_metrics
from upcycler.untrusted import MAX_JSON_BYTES

SECONDS = 20  # every refusal here is expected in well under a second
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GOOD = {"step": 0, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0,
        "expert_load": [[0.5, 0.5], [0.25, 0.75]]}
BY_SOURCE = {"sources": ["web", "code"], "expert_load_by_source": [[[0.5, 0.5], None], [[0.25, 0.75], [1.0, 0.0]]]}
HEALTH = {"expert_health": {"load_cv": [0.1, 0.2], "dead": [0, 1], "entropy": [0.6, None]}}


def line(**changes) -> bytes:
    return json.dumps({**GOOD, **changes}).encode() + b"\n"


def usage(**changes) -> bytes:
    return line(**{**BY_SOURCE, **changes})


def health(**changes) -> bytes:
    return line(**{**HEALTH, **changes})


def invoke(*args) -> tuple[str, float]:
    """`upcycle ARGS` in-process; checks the contract and returns the one error line and the seconds."""
    start = time.monotonic()
    result = CliRunner().invoke(main, [str(a) for a in args])
    took = time.monotonic() - start
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    assert took < SECONDS, f"took {took:.1f}s"
    return lines[0], took


def refused(run: Path, *extra, mentions: tuple[str, ...], out: Path | None = None) -> str:
    """`upcycle report RUN …` fails cleanly, the run unchanged and nothing at `out` (default RUN/report)."""
    out = out or run / "report"
    before = snapshot(run)
    existed = sorted(os.listdir(out)) if out.is_dir() else None
    error, _ = invoke("report", run, *extra)
    for mention in mentions:
        assert mention in error, f"{mention!r} not in {error!r}"
    assert snapshot(run) == before, "an input was modified"
    if existed is None:
        assert not os.path.lexists(out) or out.is_symlink() or not out.is_dir(), "a report was left behind"
    else:
        assert sorted(os.listdir(out)) == existed, "files were added to an existing --out"
    if out.parent.is_dir():
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "staging left"
    return error


def metrics_run(tmp_path: Path, lines: list[bytes]) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    return run


# --- metrics lines: the per-source shares, the sources, expert health, numbers ---------------------------
names = [f"s{i}" for i in range(300)]
BAD_LINES = {
    # expert_load_by_source
    "by_source not a list": (usage(expert_load_by_source="lots"), "expert_load_by_source must be"),
    "by_source empty": (usage(expert_load_by_source=[]), "expert_load_by_source must be"),
    "by_source 2-d": (usage(expert_load_by_source=[[0.5, 0.5], [0.5, 0.5]]), "rows must be"),
    "by_source ragged": (usage(expert_load_by_source=[[[0.5, 0.5], [1.0]], [[1.0, 0.0], None]]), "ragged"),
    "by_source NaN": (usage().replace(b"0.25", b"NaN"), "NaN"),
    "by_source negative": (usage(expert_load_by_source=[[[1.5, -0.5], None], [[1, 0], None]]),
                           "between 0 and 1"),
    "by_source string share": (usage(expert_load_by_source=[[["a", 0.5], None], [[1, 0], None]]), "number"),
    "by_source without sources": (line(expert_load_by_source=BY_SOURCE["expert_load_by_source"]),
                                  "without sources"),
    "sources fewer than rows": (usage(sources=["web"]), "one row per source"),
    "sources more than rows": (usage(sources=["web", "code", "math"]), "one row per source"),
    "sources not a list": (usage(sources="web"), "sources must be"),
    "source named twice": (usage(sources=["web", "web"]), "twice"),
    "source with a newline": (usage(sources=["we\nb", "code"]), "data source's name"),
    "source with an escape code": (usage(sources=["\x1b[2Jweb", "code"]), "data source's name"),
    "source of 10 MB": (usage(sources=["w" * 10_000_000, "code"]), "1 to 255 characters"),
    "source empty": (usage(sources=["", "code"]), "sources must be"),
    "by_source layers differ from expert_load": (usage(expert_load=[[0.5, 0.5]]), "covers 2 layers"),
    "by_source experts differ from expert_load": (
        usage(expert_load_by_source=[[[0.2, 0.3, 0.5], None], [[1, 0, 0], None]]), "covers 2 layers × 3"),
    # expert_health
    "health not a mapping": (health(expert_health=[1, 2]), "expert_health must be a mapping"),
    "health value not a list": (health(expert_health={"load_cv": 0.5}), "expert_health.load_cv"),
    "health empty list": (health(expert_health={"dead": []}), "expert_health.dead"),
    "health ragged": (health(expert_health={"load_cv": [0.1, 0.2], "dead": [0]}), "different lengths"),
    "health string": (health(expert_health={"entropy": ["high", 1.0]}), "expert_health.entropy"),
    "health huge": (health(expert_health={"load_cv": [1e308, 0.1]}), "expert_health.load_cv"),
    "health Infinity": (health().replace(b"0.1", b"Infinity"), "Infinity"),
    # numbers and names that cannot be drawn
    "loss 1e308": (line(loss=1e308), "loss must be between"),
    "grad_norm -1e308": (line(grad_norm=-1e308), "grad_norm must be between"),
    "step 10**30": (line(step=10**30), "step must be between"),
    "expert_load share 1e308": (line(expert_load=[[1e308, 0.0], [0.5, 0.5]]), "between 0 and 1"),
    "expert_load negative share": (line(expert_load=[[-0.5, 1.5], [0.5, 0.5]]), "between 0 and 1"),
    "loss of a source named with a tab": (line(**{"loss/a\tb": 1.0}), "data source's name"),
    "loss of a source with no name": (line(**{"loss/": 1.0}), "data source's name"),
    "loss of a source named 1 MB": (line(**{"loss/" + "a" * 1_000_000: 1.0}), "1 to 255 characters"),
    "loss of a source not a number": (line(**{"loss/web": "low"}), "loss/web must be a number"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_new_record_fails_naming_file_and_line(tmp_path, case):
    bad, mention = BAD_LINES[case]
    run = metrics_run(tmp_path, [usage(), bad, usage(step=2)])
    refused(run, mentions=("metrics.jsonl:2", mention))


# --- resumed runs whose shapes change mid-file -----------------------------------------------------------
MIXED = {
    "sources renamed": ([usage(), usage(step=1, sources=["web", "math"])], "metrics.jsonl:2", "sources are"),
    "a source added": ([usage(), usage(step=1, sources=["web", "code", "math"],
                                       expert_load_by_source=[[[0.5, 0.5]] * 3] * 2)],
                       "metrics.jsonl:2", "sources are"),
    "experts change": ([usage(), usage(step=1, expert_load=[[0.2, 0.3, 0.5]] * 2,
                                       expert_load_by_source=[[[0.2, 0.3, 0.5], None]] * 2)],
                       "metrics.jsonl:2", "expert_load is 2×3"),
    "by_source experts change after null rows": (
        [line(sources=["web"], expert_load_by_source=[[None], [None]]),
         line(step=1, sources=["web"], expert_load_by_source=[[[0.5, 0.5]], [[1, 0]]]),
         line(step=2, sources=["web"], expert_load=[[0.2, 0.3, 0.5]] * 2,
              expert_load_by_source=[[[0.2, 0.3, 0.5]], [None]])],
        "metrics.jsonl:3", "expert_load is 2×3"),
    "by_source layers change": ([usage(), line(step=1, expert_load=[[0.5, 0.5]], sources=["web", "code"],
                                               expert_load_by_source=[[[0.5, 0.5], None]])],
                                "metrics.jsonl:2", "expert_load is 1×2"),
    "health layers change": ([health(), health(step=1, expert_health={"load_cv": [0.1, 0.2, 0.3]})],
                             "step 1", "covers 3 layers"),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_resumed_run_with_other_shapes_mid_file_is_refused(tmp_path, case):
    lines, where, mention = MIXED[case]
    run = metrics_run(tmp_path, lines)
    refused(run, mentions=(where, mention))


# --- numbers in the input that would size the work or the memory ----------------------------------------
SIZES = {
    "200,000 experts in one layer": [line(expert_load=[[0] * 199_999 + [1]])],
    "1,000 MoE layers": [line(expert_load=[[1.0]] * 1000)],
    "300 sources of null rows": [line(expert_load=[[1.0]], sources=names,
                                      expert_load_by_source=[[None] * 299 + [[1.0]]])],
    "10^6 sources": [line(expert_load=[[1.0]], sources=[f"s{i}" for i in range(10**6)],
                          expert_load_by_source=[[None] * (10**6 - 1) + [[1.0]]])],
    "null rows expanding to 2^24 cells": [line(expert_load=[[1.0] + [0.0] * 4095] * 100,
                                               sources=names[:200],
                                               expert_load_by_source=[[[1.0] + [0.0] * 4095] + [None] * 199]
                                               + [[None] * 200] * 99)],
    "300 loss/<source> names": [line(**{f"loss/{n}": 1.0 for n in names})],
    "expert_health of 1,000 layers": [line(expert_health={"load_cv": [0.0] * 1000})],
}


@pytest.mark.parametrize("case", list(SIZES))
def test_sizes_beyond_what_the_report_draws_are_refused_with_the_limit(tmp_path, case):
    run = metrics_run(tmp_path, SIZES[case])
    error = refused(run, mentions=("metrics.jsonl: step 0", "the report draws no more"))
    assert "more than" in error


# --- the metrics file itself ----------------------------------------------------------------------------
def _file_cases(run: Path, case: str) -> str:
    log = run / "metrics.jsonl"
    if case == "symlink loop":
        log.symlink_to(log)
        return "cannot open"
    if case == "dangling symlink":
        log.symlink_to(run / "gone.jsonl")
        return "missing"
    if case == "directory":
        log.mkdir()
        return "is a directory"
    if case == "fifo":
        os.mkfifo(log)
        return "not a regular file"
    if case == "symlink to /dev/zero":
        log.symlink_to("/dev/zero")
        return "not a regular file"
    if case == "empty":
        log.write_bytes(b"")
        return "no complete step"
    if case == "only blank lines":
        log.write_bytes(b"\n\n  \n")
        return "no complete step"
    if case == "binary garbage":
        log.write_bytes(bytes(range(256)) * 64 + b"\n")
        return "metrics.jsonl:1"
    if case == "not UTF-8 in a source name":
        log.write_bytes(usage().replace(b'"web"', b'"w\xffb"'))
        return "metrics.jsonl:1"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["symlink loop", "dangling symlink", "directory", "fifo", "symlink to /dev/zero",
                                  "empty", "only blank lines", "binary garbage", "not UTF-8 in a source name"])
def test_metrics_file_that_is_not_a_log_is_refused(tmp_path, case):
    run = tmp_path / "run"
    run.mkdir()
    mention = _file_cases(run, case)
    refused(run, mentions=("metrics.jsonl", mention))


# --- the report's output ----------------------------------------------------------------------------------
def _out_cases(tmp_path: Path, run: Path, case: str) -> tuple[Path, str]:
    out = tmp_path / "out"
    if case == "a file":
        out.write_bytes(b"keep")
        return out, "not a directory"
    if case == "/dev/full":
        return Path("/dev/full"), "not a directory"
    if case == "under /dev/full":
        return Path("/dev/full/report"), "is a file"
    if case == "the run's metrics.jsonl":
        return run / "metrics.jsonl", "not a directory"
    if case == "a symlink to metrics.jsonl":
        out.symlink_to(run / "metrics.jsonl")
        return out, "not a directory"
    if case == "a dangling symlink":
        out.symlink_to(tmp_path / "nowhere")
        return out, "leads nowhere"
    if case == "a symlink loop":
        out.symlink_to(out)
        return out, "leads nowhere"
    if case == "holds a directory named loss.png":
        out.mkdir()
        (out / "expert_load_layer0.png").write_bytes(b"old")
        (out / "loss.png").mkdir()
        return out, "loss.png: is a directory"
    if case == "read-only":
        if os.geteuid() == 0:
            return Path("/sys/upcycler-report"), "cannot"  # root ignores modes; /sys refuses even root
        out.mkdir()
        out.chmod(0o500)
        return out, "cannot write"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["a file", "/dev/full", "under /dev/full", "the run's metrics.jsonl",
                                  "a symlink to metrics.jsonl", "a dangling symlink", "a symlink loop",
                                  "holds a directory named loss.png", "read-only"])
def test_bad_out_is_refused_and_leaves_no_partial_set(tmp_path, case):
    run = metrics_run(tmp_path, [usage(**HEALTH), usage(step=1, **HEALTH)])
    out, mention = _out_cases(tmp_path, run, case)
    before = snapshot(tmp_path) if case != "read-only" else None
    try:
        refused(run, "--out", out, mentions=(mention,), out=out)
        if before is not None:
            assert snapshot(tmp_path) == before, "something was written or changed"
        if case == "holds a directory named loss.png":
            assert (out / "expert_load_layer0.png").read_bytes() == b"old"
    finally:
        if out.is_dir() and not out.is_symlink() and case == "read-only":
            out.chmod(0o700)


def test_report_into_a_symlink_to_the_run_dir_adds_plots_only(tmp_path):
    """--out may lead into the run (it is not written to): the log stays byte-identical."""
    run = metrics_run(tmp_path, [usage(**HEALTH), usage(step=1, **HEALTH)])
    (tmp_path / "out").symlink_to(run)
    before = (run / "metrics.jsonl").read_bytes()
    result = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.stderr
    assert (run / "metrics.jsonl").read_bytes() == before
    assert {"expert_usage_by_source.png", "expert_health.png", "loss.png"} <= set(os.listdir(run))


def test_extreme_but_valid_numbers_are_drawn(tmp_path):
    """The largest magnitudes a line may hold, nulls everywhere a null is allowed: a report, no error."""
    big = 1e300
    run = metrics_run(tmp_path, [
        usage(loss=big, grad_norm=-big, mfu=big, **{"loss/web": -big, "loss/a$x^$": 1.0},
              expert_health={"load_cv": [big, None], "entropy": [None, None], "dead": [0, -big]}),
        usage(step=1, loss=None, lr=None, sources=["web", "code"],
              expert_load_by_source=[[None, None], [None, None]], expert_health={}),
        usage(step=2, loss=-big, tokens_per_s=0, expert_load=[[0.0, 0.0], [0.0, 0.0]]),
    ])
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert {"expert_usage_by_source.png", "expert_health.png"} <= set(os.listdir(run / "report"))


# --- a 100 MB line: refused with the limit named, read no further than the limit --------------------------
_RSS = """
import sys
from upcycler.cli import main
try:
    main.main(sys.argv[1:])
finally:
    print(next(x.split()[1] for x in open("/proc/self/status") if x.startswith("VmHWM:")), file=sys.stderr)
"""


def _peak(*args) -> tuple[subprocess.CompletedProcess, int]:
    proc = subprocess.run([sys.executable, "-c", _RSS, *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)
    *rest, peak = proc.stderr.splitlines()
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, "\n".join(rest)), int(peak) * 1024


def test_a_100_mb_line_is_refused_within_a_memory_bound(tmp_path):
    (tmp_path / "a").mkdir()
    small = metrics_run(tmp_path / "a", [line(), line(step=1)])
    big = tmp_path / "b" / "run"
    big.mkdir(parents=True)
    with open(big / "metrics.jsonl", "wb") as f:
        f.write(line())
        f.write(b'{"step": 1, "x": "')
        f.writelines(b"a" * 1_000_000 for _ in range(100))
        f.write(b'"}\n')
    before = (big / "metrics.jsonl").stat()
    start = time.monotonic()
    proc, peak = _peak("report", big)
    assert time.monotonic() - start < 60
    assert_clean_failure(proc, mentions="metrics.jsonl:2: line longer than 67,108,864 bytes")
    _, baseline = _peak("report", small, "--out", "/dev/full")  # refused after reading its log
    assert peak - baseline < 1.3 * MAX_JSON_BYTES, f"{(peak - baseline) / 2**20:.0f} MiB over the baseline"
    after = (big / "metrics.jsonl").stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert not (big / "report").exists()


# --- convert --weights ema --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def orbax_step(tiny_dir, tmp_path_factory) -> Path:
    """An Orbax output without an EMA (what a run without optimizer.ema saves)."""
    out = tmp_path_factory.mktemp("orbax") / "step"
    result = CliRunner().invoke(main, ["convert", str(tiny_dir("llama")), str(out), "--to", "orbax",
                                       "--no-verify"])
    assert result.exit_code == 0, result.stderr
    return out


@pytest.mark.parametrize("case", ["no ema", "ema is a file", "ema is a dangling symlink", "ema is empty",
                                  "unknown --weights", "step missing", "hf with ema"])
def test_convert_weights_ema_refusals(orbax_step, tiny_dir, tmp_path, case):
    src = tmp_path / "step"
    os.symlink(orbax_step, src, target_is_directory=True) if case in ("no ema", "unknown --weights") else None
    if case in ("ema is a file", "ema is a dangling symlink", "ema is empty"):
        src.mkdir()
        for entry in orbax_step.iterdir():
            (src / entry.name).symlink_to(entry)
        if case == "ema is a file":
            (src / "ema").write_bytes(b"x")
        elif case == "ema is a dangling symlink":
            (src / "ema").symlink_to(tmp_path / "nowhere")
        else:
            (src / "ema").mkdir()
    args, mention = {
        "no ema": (["--weights", "ema"], "holds no ema/ weights"),
        "ema is a file": (["--weights", "ema"], "holds no ema/ weights"),
        "ema is a dangling symlink": (["--weights", "ema"], "holds no ema/ weights"),
        "ema is empty": (["--weights", "ema"], "no Orbax _METADATA"),
        "unknown --weights": (["--weights", "average"], "--weights"),
        "step missing": (["--weights", "ema"], "step"),
        "hf with ema": (["--weights", "ema"], "holds one set of weights"),
    }[case]
    source = tiny_dir("llama") if case == "hf with ema" else src
    before = snapshot(orbax_step)
    error, _ = invoke("convert", source, tmp_path / "dst", *args)
    assert mention in error, error
    assert snapshot(orbax_step) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".dst", "dst"))] == []


# --- Hypothesis: the new record parsers ---------------------------------------------------------------
shares = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.none(),
                   st.text(max_size=3), st.booleans(), st.just(10**400))
rows = st.none() | st.lists(shares, max_size=4) | shares
source_names = st.text(max_size=6) | st.sampled_from(["web", "code", "a$b", "x\n", "-a", "a.b_c-1"])
by_source_records = st.fixed_dictionaries(
    {"step": st.integers(0, 5)},
    optional={
        "sources": st.lists(source_names, max_size=4) | source_names,
        "expert_load_by_source": st.lists(st.lists(rows, max_size=4) | rows, max_size=3) | rows,
        "expert_load": st.lists(st.lists(shares, max_size=4), max_size=3),
        "expert_health": st.dictionaries(st.sampled_from(["load_cv", "dead", "entropy", "bias_norm", "x"]),
                                         st.lists(shares, max_size=4) | shares, max_size=4) | shares,
    },
)


def _parse_or_refuse(parse):
    try:
        return parse()
    except UpcyclerError as err:
        assert "\n" not in str(err) and len(str(err)) < 1000, str(err)
        return None


@FUZZ
@given(by_source_records)
def test_new_records_parse_or_fail_with_one_error(record):
    text = json.dumps(record, allow_nan=True)
    parsed = _parse_or_refuse(lambda: parse_metrics_line(text, "metrics.jsonl:1"))
    if parsed is not None and "expert_load_by_source" in parsed:
        assert len(parsed["sources"]) == len(parsed["expert_load_by_source"][0])


@FUZZ
@given(st.lists(by_source_records, min_size=1, max_size=4))
def test_logs_of_new_records_read_or_fail_with_one_error(records):
    with tempfile.TemporaryDirectory() as tmp:
        text = "".join(json.dumps(r, allow_nan=True) + "\n" for r in records)
        (Path(tmp) / "metrics.jsonl").write_text(text)
        _parse_or_refuse(lambda: read_metrics(Path(tmp)))
