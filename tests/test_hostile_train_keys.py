"""Hostile input to the training keys added since the last sweep, and to `--compile-only`'s topology and budget.

The keys: optimizer.ema, optimizer.trainable, loss.bias_update_rate / bias_update, loss.spike,
checkpoint.hf_every / hf_dtype, model.init_from_merge, model.moe_dispatch / comm_dtype / moe_chunks /
grad_comm_dtype; and `--topology`, `--hbm-budget`. Each bad input, run in-process through the real CLI
(`CliRunner`), must give exit 2 by `SystemExit` (no other exception), exactly one `error:` line naming
the key and the fix, its inputs' bytes and mtimes unchanged, no run directory, within `SECONDS` each
(the refusals come before JAX compiles anything). Three cases go through a real subprocess. Then
Hypothesis: the new keys of the config, the `init_from_merge` section and the topology names turn any
generated input into a value or one `UpcyclerError`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import resource
import time
from pathlib import Path

import pytest
import trainer_fixtures as F
from cli_helpers import assert_clean_failure, run_cli
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_train import _mutate, _parse_or_refuse, _valid_config, json_values, state

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.schema import from_mapping
from upcycler.train.aot.topology import MAX_CHIPS, parse_slice
from upcycler.train.config import AVERAGING_METHODS, InitMergeConfig, TrainConfig, load_config
from upcycler.train.techniques.init_merge import merge_sources, method_options

SECONDS = 10  # per refused case, in-process (a hang or a runaway search fails the test)
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def ws(ws, tmp_path_factory):
    """The shared trainer workspace (conftest's `ws`), plus a finished 4-step run (checkpoints 2 and 4) to
    average from."""
    ws = dict(ws)
    src = tmp_path_factory.mktemp("source")
    cfg = F.write_config(src / "train.yaml", F.config_dict(src, ws["dense"], ws["data"], steps=4,
                                                           **{"checkpoint.async": False}))
    result = CliRunner().invoke(main, ["continued-pretrain", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    ws["source_run"] = src / "run"
    return ws


def refused(ws, tmp_path, args, mentions, model="dense", changes=None, inputs=()) -> str:
    """`continued-pretrain --config C ARGS` in-process: exit 2 by SystemExit, one `error:` line naming
    `mentions`, the config and `inputs` untouched, no run_dir, within SECONDS."""
    cfg = F.write_config(tmp_path / "train.yaml",
                         F.config_dict(tmp_path, ws[model], ws["data"], **(changes or {})))
    roots = (cfg, ws[model], ws["data"], *inputs)
    before = state(*roots)
    started = time.monotonic()
    result = CliRunner().invoke(main, ["continued-pretrain", "--config", str(cfg), *map(str, args)])
    elapsed = time.monotonic() - started
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert mentions in lines[0], f"{mentions!r} not in {lines[0]!r}"
    assert "Traceback" not in result.output
    assert elapsed < SECONDS, f"took {elapsed:.1f} s"
    assert state(*roots) == before, "an input was modified"
    assert not (tmp_path / "run").exists(), "a run directory was left behind"
    return lines[0]


def sets(**values) -> list[str]:
    return [a for key, value in values.items() for a in ("--set", f"{key.replace('__', '.')}={value}")]


# --- each new key, on its own ---------------------------------------------------------------------------

KEY_CASES = {  # case: (--set items, mention, model)
    "ema 1": (sets(optimizer__ema=1.0), "optimizer.ema", "dense"),
    "ema 2": (sets(optimizer__ema=2), "optimizer.ema", "dense"),
    "ema -1": (sets(optimizer__ema=-1), "optimizer.ema", "dense"),
    "ema NaN": (sets(optimizer__ema=".nan"), "optimizer.ema", "dense"),
    "ema a word": (sets(optimizer__ema="high"), "optimizer.ema", "dense"),
    "ema a bool": (sets(optimizer__ema="true"), "optimizer.ema", "dense"),
    "spike window 0": (sets(loss__spike="{window: 0}"), "loss.spike.window", "dense"),
    "spike window 10^12": (sets(loss__spike="{window: 1000000000000}"), "loss.spike.window", "dense"),
    "spike factor NaN": (sets(loss__spike="{factor: .nan}"), "loss.spike.factor", "dense"),
    "spike factor 1": (sets(loss__spike="{factor: 1}"), "loss.spike.factor", "dense"),
    "spike factor inf": (sets(loss__spike="{factor: .inf}"), "loss.spike.factor", "dense"),
    "spike action unknown": (sets(loss__spike="{action: explode}"), "loss.spike.action", "dense"),
    "spike average 0": (sets(loss__spike="{average: 0}"), "loss.spike.average", "dense"),
    "spike a number": (sets(loss__spike=5), "loss.spike", "dense"),
    "spike a list": (sets(loss__spike="[1, 2]"), "loss.spike", "dense"),
    "spike unknown key": (sets(loss__spike="{windw: 3}"), "windw", "dense"),
    "bias rate NaN": (sets(loss__bias_update_rate=".nan"), "loss.bias_update_rate", "moe"),
    "bias rate negative": (sets(loss__bias_update_rate=-0.1), "loss.bias_update_rate", "moe"),
    "bias rate inf": (sets(loss__bias_update_rate=".inf"), "loss.bias_update_rate", "moe"),
    "bias update unknown": (sets(loss__bias_update="maybe"), "loss.bias_update", "moe"),
    "hf_every 0.5": (sets(checkpoint__hf_every=0.5), "checkpoint.hf_every", "dense"),
    "hf_every -1": (sets(checkpoint__hf_every=-1), "checkpoint.hf_every", "dense"),
    "hf_every 10^18": (sets(checkpoint__hf_every=10**18), "checkpoint.hf_every", "dense"),
    "hf_every 5000 digits": (sets(checkpoint__hf_every="9" * 5000), "hf_every", "dense"),
    "hf_dtype unknown": (sets(checkpoint__hf_dtype="int4"), "checkpoint.hf_dtype", "dense"),
    "trainable an invalid regex": (sets(optimizer__trainable="'(unclosed'"), "optimizer.trainable", "dense"),
    "trainable empty": (sets(optimizer__trainable="''"), "optimizer.trainable", "dense"),
    "trainable a number": (sets(optimizer__trainable=5), "optimizer.trainable", "dense"),
    "dispatch unknown": (sets(model__moe_dispatch="ring"), "model.moe_dispatch", "moe"),
    "comm dtype unknown": (sets(model__comm_dtype="fp4"), "model.comm_dtype", "moe"),
    "grad comm dtype unknown": (sets(model__grad_comm_dtype="fp8"), "model.grad_comm_dtype", "moe"),
    "moe_chunks 0": (sets(model__moe_chunks=0), "model.moe_chunks", "moe"),
    "moe_chunks 10^9": (sets(model__moe_chunks=10**9), "model.moe_chunks", "moe"),
    "init_from_merge a number": (sets(model__init_from_merge=5), "model.init_from_merge", "dense"),
    "init_from_merge a list": (sets(model__init_from_merge="[a, b]"), "model.init_from_merge", "dense"),
}


@pytest.mark.parametrize("case", list(KEY_CASES))
def test_a_bad_value_of_a_new_key_is_one_error(ws, tmp_path, case):
    args, mentions, model = KEY_CASES[case]
    refused(ws, tmp_path, args, mentions, model)


# --- combinations that cannot work together --------------------------------------------------------------

COMBINATIONS = {
    "compression under gspmd": (sets(model__comm_dtype="bf16"), "model.moe_dispatch", "moe"),
    "all_to_all with expert=1": (sets(model__moe_dispatch="all_to_all"), "mesh.expert", "moe"),
    "fp8 combine with expert=1": (sets(model__moe_dispatch="all_gather", model__comm_dtype="fp8"),
                                  "mesh.expert", "moe"),
    "chunks without all_gather": (sets(model__moe_chunks=2), "model.moe_dispatch", "moe"),
    "dispatch on a dense model": (sets(model__moe_dispatch="all_gather"), "model.moe_dispatch", "dense"),
    "grad compression on a dense model": (sets(model__grad_comm_dtype="bf16"), "model.grad_comm_dtype", "dense"),
    "balancing on a dense model": (sets(loss__bias_update_rate=0.01), "loss.bias_update_rate", "dense"),
    "balancing on a softmax router": (sets(loss__bias_update_rate=0.01), "loss.bias_update_rate", "moe"),
    "rate with a frozen bias": (sets(loss__bias_update_rate=0.01, loss__bias_update="frozen"),
                                "loss.bias_update", "moe"),
    "rewind averaging more than kept": (sets(loss__spike="{action: rewind, average: 5}", checkpoint__keep=2),
                                        "checkpoint.keep", "dense"),
    "trainable matching nothing": (sets(optimizer__trainable="no_such_tensor"), "optimizer.trainable", "dense"),
    "trainable a backtracking regex": (sets(optimizer__trainable="'^([a-z_.0-9]|[a-z_.0-9])*!$'"),
                                       "took over", "moe"),
    "new_layers without a depth growth": (sets(optimizer__trainable="new_layers"), "new_layers", "dense"),
    "hf_every past the last step": (sets(checkpoint__hf_every=12), "checkpoint.hf_every", "dense"),
    "a spike window as long as the run": (sets(loss__spike="{window: 6}"), "loss.spike.window", "dense"),
}


@pytest.mark.parametrize("case", list(COMBINATIONS))
def test_options_that_cannot_work_together_are_one_error(ws, tmp_path, case):
    args, mentions, model = COMBINATIONS[case]
    refused(ws, tmp_path, args, mentions, model)



def test_all_to_all_over_the_devices_that_remain_when_one_remains(ws):
    """`mesh.expert: -1` resolves to what the other axes leave: all_to_all over a single device has nothing to
    exchange and is refused when the mesh is built, naming both keys; over two devices it builds."""
    import jax

    from upcycler.io.hf_read import read_spec
    from upcycler.train.config import MeshConfig
    from upcycler.train.loop.mesh import build_mesh

    spec = read_spec(ws["moe"])
    one = jax.devices()[:1]
    with pytest.raises(UpcyclerError, match="mesh.expert -1 leaves it 1 of the 1 devices .* model.moe_dispatch"):
        build_mesh(MeshConfig(data=1, fsdp=1, expert=-1), 8, spec, devices=one, moe_dispatch="all_to_all")
    assert build_mesh(MeshConfig(data=1, fsdp=1, expert=-1), 8, spec, devices=one).shape["expert"] == 1
    if len(jax.devices()) >= 2:
        mesh = build_mesh(MeshConfig(data=1, fsdp=1, expert=-1), 8, spec, devices=jax.devices()[:2],
                          moe_dispatch="all_to_all")
        assert mesh.shape["expert"] == 2

# --- model.init_from_merge: the inputs it names -----------------------------------------------------------

def _merge_sources(ws, tmp: Path) -> dict[str, tuple[str, str]]:
    run = ws["source_run"]
    fifo, loop, dangling = tmp / "fifo", tmp / "loop", tmp / "dangling"
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    dangling.symlink_to(tmp / "nowhere")
    (tmp / "alias").symlink_to(run / "4")
    return {  # case: (the section, mention)
        "nonexistent": ({"sources": [f"{tmp}/nowhere"], "last": 2}, "nowhere"),
        "a FIFO": ({"sources": [str(fifo)]}, "fifo: not a directory"),
        "a symlink loop": ({"sources": [str(loop)]}, "loop"),
        "a dangling symlink": ({"sources": [str(dangling)]}, "dangling"),
        "a device": ({"sources": ["/dev/zero"]}, "/dev/zero"),
        "a file": ({"sources": [str(ws["tokenizer"])]}, "not a directory"),
        "the data directory": ({"sources": [str(ws["data"])]}, "not a checkpoint"),
        "the same checkpoint twice": ({"sources": [f"{run}/4", f"{run}/4"]}, "merged twice"),
        "the same checkpoint through a symlink": ({"sources": [f"{run}/4", f"{tmp}/alias"]}, "merged twice"),
        "the same run twice": ({"sources": [str(run), str(run)], "last": 2}, "merged twice"),
        "another architecture": ({"sources": [f"{run}/2", str(ws["moe"])]}, "family"),
        "another architecture than model.init": ({"sources": [str(ws["moe"])]}, "differ from model.init"),
        "no source": ({"sources": [], "last": 3}, "name a run directory"),
        "the old one-string form": (f"{run} --last 3", "must be a mapping"),
        "every 0": ({"sources": [str(run)], "every": 0}, "model.init_from_merge.every"),
        "last huge": ({"sources": [str(run)], "last": 10**20}, "model.init_from_merge.last"),
        "last 5000 digits": ({"sources": [str(run)], "last": _Raw("9" * 5000)}, "model.init_from_merge"),
        "alpha NaN": ({"sources": [str(run)], "method": "ema", "alpha": float("nan")}, "alpha"),
        "alpha 2": ({"sources": [str(run)], "method": "ema", "alpha": 2}, "alpha"),
        "alpha without ema": ({"sources": [str(run)], "method": "sma", "alpha": 0.5}, "option of method ema"),
        "not an average": ({"sources": [str(run)], "method": "ties"}, "model.init_from_merge.method"),
        "unknown key": ({"sources": [str(run)], "weights": "1,2"}, "'weights'"),
    }


class _Raw(str):
    """A value written into the YAML as it is (an integer too long for Python to print)."""


def _yaml(section) -> str:
    """A `--set` value for the section: JSON (which YAML reads), NaN as YAML's .nan, `_Raw` as it is."""
    if isinstance(section, str):
        return json.dumps(section)

    def value(v) -> str:
        if isinstance(v, _Raw):
            return str(v)
        return ".nan" if isinstance(v, float) and math.isnan(v) else json.dumps(v)

    return "{" + ", ".join(f"{k}: {value(v)}" for k, v in section.items()) + "}"


MERGE_CASES = ["nonexistent", "a FIFO", "a symlink loop", "a dangling symlink", "a device", "a file",
               "the data directory", "the same checkpoint twice", "the same checkpoint through a symlink",
               "the same run twice", "another architecture", "another architecture than model.init", "no source",
               "the old one-string form", "every 0", "last huge", "last 5000 digits", "alpha NaN", "alpha 2",
               "alpha without ema", "not an average", "unknown key"]


@pytest.mark.parametrize("case", MERGE_CASES)
def test_a_bad_merge_to_start_from_is_one_error(ws, tmp_path, case):
    (tmp_path / "links").mkdir()
    section, mentions = _merge_sources(ws, tmp_path / "links")[case]
    line = refused(ws, tmp_path, ["--set", f"model.init_from_merge={_yaml(section)}"], mentions,
                   inputs=(ws["source_run"],))
    assert "model.init_from_merge" in line


@pytest.mark.parametrize("inside", ["the source run itself", "inside the source run", "around the source run"])
def test_a_run_dir_overlapping_the_merge_source_is_refused(ws, tmp_path, inside):
    run = ws["source_run"]
    run_dir = {"the source run itself": run, "inside the source run": run / "next",
               "around the source run": run.parent}[inside]
    refused(ws, tmp_path, ["--set", f"model.init_from_merge='{run} --last 2'", "--run-dir", run_dir],
            "run_dir", inputs=(run,))
    assert not (run / "next").exists()


# --- --compile-only: topology names and budgets ---------------------------------------------------------

COMPILE_CASES = {
    "topology 100000x100000": (["--topology", "v5e:100000x100000"], "limit of 16,384 chips"),
    "topology 2^200 chips": (["--topology", f"v5e-{2**200}"], "--topology"),
    "topology 5000 digits": (["--topology", "v5e-" + "9" * 5000], "--topology"),
    "topology 5000 dims": (["--topology", "v5e:" + "x".join(["1"] * 5000)], "--topology"),
    "topology empty": (["--topology", ""], "--topology"),
    "topology zero chips": (["--topology", "v5e-0"], "--topology"),
    "topology unknown generation": (["--topology", "v99-4"], "--topology"),
    "topology a NUL": (["--topology", "v5e\x00-4"], "--topology"),
    "topology not a power of two": (["--topology", "v5e-24"], "power-of-two"),
    "budget NaN": (["--hbm-budget", "nan"], "--hbm-budget"),
    "budget negative": (["--hbm-budget", "-1GiB"], "--hbm-budget"),
    "budget zero": (["--hbm-budget", "0"], "--hbm-budget"),
    "budget 1e999": (["--hbm-budget", "1e999"], "--hbm-budget"),
    "budget huge": (["--hbm-budget", "999999999999999TiB"], "limit of"),
    "budget unit garbage": (["--hbm-budget", "16 parsecs"], "--hbm-budget"),
    "budget binary": (["--hbm-budget", "\x1b[31m\x7f"], "--hbm-budget"),
    "budget without --compile-only": (["--hbm-budget", "16GiB"], "add --compile-only"),
}


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_a_bad_topology_or_budget_is_one_error_before_compiling(ws, tmp_path, case):
    args, mentions = COMPILE_CASES[case]
    compile_only = [] if case.endswith("without --compile-only") else ["--compile-only"]
    refused(ws, tmp_path, [*compile_only, *args], mentions, model="moe")


def test_compile_only_refuses_moe_options_on_a_dense_model(ws, tmp_path):
    refused(ws, tmp_path, ["--compile-only", *sets(model__moe_dispatch="all_gather")], "is dense")


# --- through a real process: exit status, stderr, memory ---------------------------------------------------

def test_real_process_refusals(ws, tmp_path):
    """Three representative cases as a user meets them; each within SECONDS × 6 (JAX import included)."""
    cfg = F.write_config(tmp_path / "train.yaml", F.config_dict(tmp_path, ws["moe"], ws["data"]))
    before = state(cfg, ws["moe"], ws["data"])
    for args, mentions in (
        (["--compile-only", "--topology", "v5e-" + "9" * 5000], "--topology"),
        (["--set", "optimizer.trainable='^([a-z_.0-9]|[a-z_.0-9])*!$'"], "took over"),
        (["--set", f"model.init_from_merge={{sources: ['{ws['source_run']}', '{ws['source_run']}'], last: 1}}"],
         "merged twice"),
    ):
        proc = run_cli("continued-pretrain", "--config", cfg, *args, check=False, timeout=SECONDS * 6)
        assert proc.returncode == 2
        assert_clean_failure(proc, mentions=mentions)
    assert state(cfg, ws["moe"], ws["data"]) == before
    assert not (tmp_path / "run").exists()


def test_huge_numbers_in_the_new_keys_use_no_memory_of_their_size(ws, tmp_path):
    """A topology of 10^10 chips, a window of 10^12 losses, a 1 PiB+ budget: refused within 64 MiB of
    peak memory growth (nothing is allocated in proportion to the number)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for args, mentions in (
        (["--compile-only", "--topology", "v5e:100000x100000"], "limit"),
        (sets(loss__spike="{window: 1000000000000}"), "window"),
        (["--compile-only", "--hbm-budget", "999999999999999TiB"], "limit"),
    ):
        refused(ws, tmp_path, args, mentions, model="moe")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024, f"peak memory grew by {grown_kib} KiB"


# --- Hypothesis ---------------------------------------------------------------------------------------------

NEW_KEYS = [("optimizer", "ema"), ("optimizer", "trainable"), ("loss", "bias_update_rate"), ("loss", "bias_update"),
            ("loss", "spike"), ("checkpoint", "hf_every"), ("checkpoint", "hf_dtype"), ("model", "init_from_merge"),
            ("model", "moe_dispatch"), ("model", "comm_dtype"), ("model", "moe_chunks"),
            ("model", "grad_comm_dtype"), ("mesh", "expert"), ("checkpoint", "keep")]
new_values = (
    json_values
    | st.sampled_from(["gspmd", "all_to_all", "all_gather", "fp32", "bf16", "fp8", "native", "on", "frozen",
                       "all", "new_layers", "(", "(a+)+$", "experts|router", "", "bfloat16", "float16"])
    | st.floats(-2, 2)
    | st.fixed_dictionaries({}, optional={"factor": json_values | st.floats(0, 10), "window": json_values
                                         | st.integers(-2, 1 << 21), "action": st.sampled_from(["stop", "rewind"])
                                         | json_values, "average": st.integers(-1, 2000) | json_values})
)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(NEW_KEYS), new_values), min_size=1, max_size=4))
def test_new_keys_mutated_are_a_config_or_one_error(changes):
    config = _valid_config()
    for path, value in changes:
        config.setdefault(path[0], {})
        _mutate(config, path, "set", value)
    result = _parse_or_refuse(lambda: TrainConfig.from_dict(copy.deepcopy(config), "train.yaml"))
    if result is not None:
        assert TrainConfig.from_dict(result.to_dict()) == result
        spike = result.loss.spike
        assert spike is None or 1 <= spike.window <= 1 << 20
        assert 0 <= result.optimizer.ema < 1 and result.checkpoint.hf_every >= 0


merge_values = st.one_of(st.none(), st.integers(-2, 10**6) | st.just(10**20), st.floats(allow_nan=True),
                         st.sampled_from(["sma", "ema", "ties", "run", "", "\0", "9" * 5000, "a b"]),
                         st.lists(st.text(max_size=8), max_size=3), st.text(max_size=8))


@FUZZ
@given(st.dictionaries(st.sampled_from(["sources", "last", "every", "until", "method", "alpha", "weights"]),
                       merge_values, max_size=7))
def test_init_from_merge_section_is_read_or_one_error(raw):
    section = _parse_or_refuse(lambda: from_mapping(InitMergeConfig, raw, "model.init_from_merge"))
    if section is not None:
        checked = _parse_or_refuse(lambda: (merge_sources(section), method_options(section)))
        if checked is not None:
            paths, options = checked
            assert paths and all(isinstance(v, int) for v in (section.last, section.every, section.until)
                                 if v is not None)
            assert section.method in AVERAGING_METHODS and set(options) <= {"alpha"}


@FUZZ
@given(st.from_regex(r"\A(v\d{1,4}[a-z]?|v5litepod|[a-z]{0,3})([-:])(\d{1,12}(x\d{1,12}){0,4})\Z")
       | st.text(max_size=30))
def test_topology_name_is_a_bounded_slice_or_one_error(name):
    started = time.monotonic()
    slice_ = _parse_or_refuse(lambda: parse_slice(name))
    assert time.monotonic() - started < 1
    if slice_ is not None:
        assert 1 <= slice_.chips <= MAX_CHIPS and re.fullmatch(r"v\d+[a-z]?-\d+", slice_.name)
        assert parse_slice(slice_.libtpu_name) == slice_


@settings(FUZZ, max_examples=50)
@given(st.text(alphabet="a(|)*+?.!$^\\w[]{}0-9,", max_size=24))
def test_trainable_pattern_is_bounded_or_one_error(pattern):
    """Any pattern made of regex operators: one error (invalid, matches nothing, too slow) or a selection,
    within the search limit plus slack."""
    started = time.monotonic()
    path_cfg = _valid_config()
    path_cfg["optimizer"]["trainable"] = pattern
    if _parse_or_refuse(lambda: TrainConfig.from_dict(path_cfg, "train.yaml")) is None:
        return
    from upcycler.train.loop import trainable

    _parse_or_refuse(lambda: trainable.check(pattern, F.tiny_spec(moe=True)))
    assert time.monotonic() - started < 5


def test_load_config_names_the_file_for_new_keys(ws, tmp_path):
    path = F.write_config(tmp_path / "train.yaml", F.config_dict(tmp_path, ws["dense"], ws["data"]))
    with pytest.raises(UpcyclerError, match=r"train\.yaml: optimizer\.ema"):
        load_config(path, sets=["optimizer.ema=1"])
