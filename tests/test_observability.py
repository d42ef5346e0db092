"""Watching a run: TensorBoard and W&B mirrors of the metrics log, held-out evaluation during training,
profiles, goodput and MFU.

Two runs of the tiny qwen3_moe of `trainer_fixtures` (2 MoE layers of 4 experts) with the same data and
config: `watched` with every writer (W&B offline), held-out evaluation and a profile, `plain` with none.
Each writer is read back with its own tool's reader and compared with metrics.jsonl; the held-out losses
are recomputed in numpy from the saved checkpoints; the two runs must train bit-identically.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import trainer_fixtures as F

from upcycler.errors import UpcyclerError
from upcycler.train.config import TrainConfig
from upcycler.train.loop.trainer import train
from upcycler.train.reporting.goodput import CATEGORIES
from upcycler.train.reporting.metrics import TIMING_FIELDS
from upcycler.train.reporting.metrics_log import MetricsLog

STEPS = 6
MOE_LAYERS = (1, 2)  # tiny_spec(moe=True): layer 0 dense
HEALTH = ("load_min", "load_max", "load_cv", "dead", "overload", "entropy", "bias_norm")
HELDOUT = ("json.heldout", "email.heldout")
CHANGES = {"steps": STEPS, "checkpoint.every": 2, "checkpoint.keep": 3, "metrics.expert_load_every": 3}


@pytest.fixture(scope="module")
def data(ws, tmp_path_factory):
    """The test sources, one document per line, prepared with a held-out split (`prepare-data --heldout
    0.1`): json and json.heldout, email and email.heldout; eval finds the held-out sources by itself."""
    out = tmp_path_factory.mktemp("heldout") / "data"
    files = [f"--source={name}={path}" for name, paths in F.SOURCES.items() for path in paths]
    F.run_cli("prepare-data", *files, "--tokenizer", ws["tokenizer"], "--out", out, "--format", "text",
              "--text-unit", "line", "--heldout", "0.1")
    return out


@pytest.fixture(scope="module")
def runs(ws, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("watch")
    watched = F.config_dict(root / "watched", ws["moe"], data, **CHANGES, **{
        "metrics.writers": ["jsonl", "tensorboard", "wandb"],
        "metrics.wandb": {"project": "upcycler-test", "mode": "offline"},
        "eval": {"every": 2, "batches": 2},
        "profile": {"start_step": 2, "steps": 1},
    })
    plain = F.config_dict(root / "plain", ws["moe"], data, **CHANGES, **{"metrics.writers": ["jsonl"]})
    train(TrainConfig.from_dict(watched))
    train(TrainConfig.from_dict(plain))
    return {"watched": root / "watched" / "run", "plain": root / "plain" / "run", "data": data}


def expected_scalars(record: dict) -> dict[str, float]:
    """What TensorBoard and W&B must show for one metrics.jsonl record, by name."""
    names = ["loss", "lb_loss", "z_loss", "total_loss", "grad_norm", "lr", "tokens", "step_time", "tokens_per_s",
             "mfu", "data_wait", "goodput", "loss/json", "loss/email"]
    out = {name: float(record[name]) for name in names}
    for key, value in record.items():
        if key.startswith(("eval/", "eval_start/")):
            out[key] = float(value)
    clock = record["clock"]
    out.update({f"badput/{c}": clock[c] / clock["total"] for c in CATEGORIES if c != "productive"})
    for stat in HEALTH:
        for k, layer in enumerate(MOE_LAYERS):
            if stat in record.get("expert_health", {}):
                out[f"expert_health/{stat}/layer_{layer}"] = float(record["expert_health"][stat][k])
    return out


def test_tensorboard_event_files_hold_every_scalar_of_the_log(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = F.metrics(runs["watched"])
    assert [r["step"] for r in records] == list(range(STEPS))
    events = EventAccumulator(str(runs["watched"] / "tensorboard"),
                              size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    events.Reload()
    expected = {}
    for r in records:
        for name, value in expected_scalars(r).items():
            expected.setdefault(name, {})[r["step"]] = value
    assert set(events.Tags()["scalars"]) == set(expected)
    for name, by_step in expected.items():
        logged = {e.step: e.value for e in events.Scalars(name)}
        assert logged.keys() == by_step.keys(), name
        for step, value in by_step.items():
            assert logged[step] == pytest.approx(np.float32(value), rel=1e-6, abs=1e-30), (name, step)
    assert any(k.startswith("eval/loss/") for k in expected) and "badput/checkpoint_save" in expected
    assert {step for name, by_step in expected.items() if name.startswith("eval_start/") for step in by_step} == {0}
    # the expert load of each window, as a histogram per MoE layer and one image
    windows = [r for r in records if "expert_load" in r]
    assert [r["step"] for r in windows] == [2, 5]
    for k, layer in enumerate(MOE_LAYERS):
        histograms = events.Histograms(f"expert_load/layer_{layer}")
        assert [h.step for h in histograms] == [2, 5]
        for h, r in zip(histograms, windows):
            assert h.histogram_value.num == 4
            assert h.histogram_value.sum == pytest.approx(sum(r["expert_load"][k]), rel=1e-5)
    assert [i.step for i in events.Images("expert_load")] == [2, 5]


def _wandb_history(run_dir: Path) -> dict[int, dict]:
    """The history rows of the offline W&B run under `run_dir`, read from its transaction log with W&B's
    own record schema (`wandb.proto`): blocks of 32 KiB after a 7-byte header, chunks of (crc, length,
    kind) framing protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("wandb/wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", {}
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                rows[row["_step"]] = row
    return rows


def test_wandb_offline_run_holds_the_same_history(runs):
    records = F.metrics(runs["watched"])
    rows = _wandb_history(runs["watched"])
    assert sorted(rows) == list(range(STEPS))
    for r in records:
        row = {k: v for k, v in rows[r["step"]].items() if not k.startswith("_")}
        expected = expected_scalars(r)
        assert row.keys() == expected.keys()
        for name, value in expected.items():
            assert row[name] == pytest.approx(value, rel=1e-12), (r["step"], name)


def _batches(data: Path, name: str, seq_len: int, rows: int, count: int) -> list[np.ndarray]:
    """The first `count` batches of `rows` examples of a prepared source, cut here: example i is
    tokens[i·L : i·L + L + 1] (the last one shorter)."""
    from upcycler.train.data.sources import open_source

    source = open_source(data, name)
    tokens = np.asarray(source.tokens[0:source.tokens.shape[0]], np.int64)
    examples = [tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range((len(tokens) - 2) // seq_len + 1)]
    examples = examples[:count * rows]
    return [examples[k:k + rows] for k in range(0, len(examples), rows)]


def test_heldout_losses_equal_a_separate_forward_pass_on_the_saved_weights(runs):
    from upcycler.io import read_checkpoint
    from upcycler.train.evaluation.evaluate import checkpoint_logits

    records = {r["step"]: r for r in F.metrics(runs["watched"])}
    assert [s for s, r in records.items() if "eval/loss/json.heldout" in r] == [1, 3, 5]
    for step in (1, 5):  # evaluated after step s: the parameters of checkpoint s + 1
        ckpt = read_checkpoint(runs["watched"] / str(step + 1))
        for name in HELDOUT:
            total, count = 0.0, 0
            for batch in _batches(runs["data"], name, seq_len=32, rows=8, count=2):
                for example in batch:
                    logits = checkpoint_logits(ckpt, example[None, :-1].astype(np.int32))[0].astype(np.float64)
                    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
                        - logits.max(-1, keepdims=True)
                    total -= logp[np.arange(len(example) - 1), example[1:]].sum()
                    count += len(example) - 1
            logged = records[step][f"eval/loss/{name}"]
            assert logged == pytest.approx(total / count, rel=2e-5), (step, name)
            assert records[step][f"eval/ppl/{name}"] == pytest.approx(math.exp(logged), rel=1e-9)


def test_the_starting_parameters_are_evaluated_before_the_first_step(ws, runs):
    """Step 0's record carries the held-out loss of the init (`eval_start/…`): the baseline of every curve,
    equal to a separate forward pass on the starting checkpoint; no other record has it."""
    from upcycler.io import read_checkpoint
    from upcycler.train.evaluation.evaluate import checkpoint_logits

    records = {r["step"]: r for r in F.metrics(runs["watched"])}
    assert [s for s, r in records.items() if any(k.startswith("eval_start/") for k in r)] == [0]
    ckpt = read_checkpoint(ws["moe"])
    for name in HELDOUT:
        total, count = 0.0, 0
        for batch in _batches(runs["data"], name, seq_len=32, rows=8, count=2):
            for example in batch:
                logits = checkpoint_logits(ckpt, example[None, :-1].astype(np.int32))[0].astype(np.float64)
                top = logits.max(-1, keepdims=True)
                logp = logits - np.log(np.exp(logits - top).sum(-1, keepdims=True)) - top
                total -= logp[np.arange(len(example) - 1), example[1:]].sum()
                count += len(example) - 1
        logged = records[0][f"eval_start/loss/{name}"]
        assert logged == pytest.approx(total / count, rel=2e-5), name
        assert logged > records[STEPS - 1][f"eval/loss/{name}"]  # training on these sources lowered it
        assert records[0][f"eval_start/ppl/{name}"] == pytest.approx(math.exp(logged), rel=1e-9)
    assert not any(k.startswith("eval_start/") for r in F.metrics(runs["plain"]) for k in r)


def test_watching_leaves_the_training_bit_identical(runs):
    def trained(run):
        return [{k: v for k, v in r.items() if k not in TIMING_FIELDS and not k.startswith(("eval/", "eval_start/"))}
                for r in F.metrics(run)]

    assert trained(runs["watched"]) == trained(runs["plain"])
    watched, plain = F.step_params(runs["watched"] / str(STEPS)), F.step_params(runs["plain"] / str(STEPS))
    assert [n for n in plain if not np.array_equal(plain[n], watched[n])] == []


def test_a_resume_inside_an_expert_window_logs_what_the_uninterrupted_run_did(ws, runs, tmp_path):
    """Checkpoint 2 lies inside the window [0, 3): it carries the window's counts, so a run resumed from it
    logs the same expert load, usage and health on step 2 as the run that went through."""
    resumed = tmp_path / "run"
    shutil.copytree(runs["plain"], resumed)
    for step in (4, 6):
        shutil.rmtree(resumed / str(step))
    cfg = F.config_dict(tmp_path, ws["moe"], runs["data"], **CHANGES,
                        **{"metrics.writers": ["jsonl"]})
    train(TrainConfig.from_dict(cfg), resume=True)

    def logged(run):
        return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in F.metrics(run)]

    assert logged(resumed) == logged(runs["plain"])
    assert "expert_health" in F.metrics(resumed)[2]


def test_the_profile_is_listed_by_tensorboards_profile_plugin(runs):
    from types import SimpleNamespace

    from tensorboard.plugins.base_plugin import TBContext
    from xprof.profile_plugin import ProfilePlugin

    logdir = runs["watched"] / "tensorboard"
    traces = list(logdir.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    flags = SimpleNamespace(master_tpu_unsecure_channel="")
    plugin = ProfilePlugin(TBContext(logdir=str(logdir), flags=flags))
    runs_listed = list(plugin.generate_runs())
    assert runs_listed == [traces[0].parent.name]
    tools = list(plugin.generate_tools_of_run(runs_listed[0], str(traces[0].parent)))
    assert "trace_viewer" in tools or "trace_viewer@" in tools


def test_goodput_accounts_for_slow_data_and_checkpoint_stalls(ws, tmp_path, monkeypatch):
    """A data source 0.3 s slow per batch and a save 0.3 s slow per checkpoint, every step: the clock's
    data-loading and save-stall times and shares match what the test injected (and, for the saves, timed
    around each call) within 20 %; MFU is reported without metrics.peak_flops (against a matmul measured
    on this CPU)."""
    from upcycler.train.data.mix import DataIterator
    from upcycler.train.loop.checkpointing import RunCheckpoints

    delay, steps = 0.3, 5
    next_batch, save, write = DataIterator.__next__, RunCheckpoints.save, MetricsLog.write
    stalls: list[float] = []
    written: list[float] = []

    def timed_write(self, record):
        write(self, record)
        written.append(time.monotonic())

    def slow_next(self):
        time.sleep(delay)
        return next_batch(self)

    def slow_save(self, *args, **kwargs):
        t0 = time.monotonic()
        time.sleep(delay)
        try:
            return save(self, *args, **kwargs)
        finally:
            stalls.append(time.monotonic() - t0)

    monkeypatch.setattr(DataIterator, "__next__", slow_next)
    monkeypatch.setattr(RunCheckpoints, "save", slow_save)
    monkeypatch.setattr(MetricsLog, "write", timed_write)
    init = tmp_path / "init"  # the dense model with what a chat model ships beside its weights
    shutil.copytree(ws["dense"], init)
    (init / "generation_config.json").write_text('{"eos_token_id": 0, "max_new_tokens": 7}')
    (init / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cfg = F.config_dict(tmp_path, init, ws["data"], steps=steps, **{
        "checkpoint.every": 1, "checkpoint.hf_every": steps, "metrics.peak_flops": None,
        "metrics.writers": ["jsonl"]})
    t0 = time.monotonic()
    train(TrainConfig.from_dict(cfg))
    wall = written[-1] - t0  # train() from entry to the last record's writing, by the test's clock
    records = F.metrics(tmp_path / "run")
    clock = records[-1]["clock"]
    assert len(stalls) == steps
    stalled = sum(stalls[:-1])  # the saves after steps 0..3 are in the last record (the last comes after it)
    assert stalled >= (steps - 1) * delay
    assert clock["data_loading"] == pytest.approx(steps * delay, rel=0.2)
    assert clock["checkpoint_save"] == pytest.approx(stalled, rel=0.2)
    # the clock covers the whole run: train() from entry to the last record
    assert clock["total"] == pytest.approx(wall, rel=0.2)
    assert clock["data_loading"] / clock["total"] == pytest.approx(steps * delay / wall, rel=0.2)
    assert clock["checkpoint_save"] / clock["total"] == pytest.approx(stalled / wall, rel=0.2)
    assert [r["data_wait"] >= delay for r in records] == [True] * steps
    assert sum(clock[c] for c in CATEGORIES) == pytest.approx(clock["total"], abs=1e-4)
    assert clock["productive"] == pytest.approx(sum(r["step_time"] for r in records), abs=1e-4)
    assert records[-1]["goodput"] == pytest.approx(clock["productive"] / clock["total"])
    assert clock["program_startup"] > 0 and clock["training_prep"] > 0 and clock["recovery"] == 0
    assert all(0 < r["mfu"] < 1 for r in records)
    # the steps and their Hugging Face export carry the init's generation config and chat template
    for where in (tmp_path / "run" / str(steps), tmp_path / "run" / str(steps) / "hf"):
        for name in ("generation_config.json", "chat_template.jinja", "tokenizer.json"):
            assert (where / name).read_bytes() == ((init if name != "tokenizer.json" else ws["tokenizer"].parent)
                                                   / name).read_bytes(), (where, name)


def test_a_resume_reads_only_the_end_of_a_long_log(tmp_path):
    """10,000 logged steps whose first line is not even JSON: a resume at step 9,990 cuts the log after
    step 9,989 and takes its clock without ever reading that far back."""
    run = tmp_path / "run"
    run.mkdir()
    clock = {c: 1.0 for c in CATEGORIES} | {"total": float(len(CATEGORIES)), "wall": 1.7e9}
    lines = ["not a record\n"] + [json.dumps({"step": s, "loss": 1.0, "clock": clock | {"wall": 1.7e9 + s}}) + "\n"
                                  for s in range(1, 10_000)]
    (run / "metrics.jsonl").write_text("".join(lines) + '{"step": 10000, "lo')  # a torn last line
    log = MetricsLog(run, enabled=True, start_step=9_990)
    log.close()
    assert log.kept["step"] == 9_989 and log.last["step"] == 9_999
    assert log.kept["clock"]["wall"] == 1.7e9 + 9_989
    kept = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert kept == lines[:9_990]


def test_eval_without_a_heldout_split_is_refused_before_the_run_starts(ws, tmp_path):
    cfg = F.config_dict(tmp_path, ws["dense"], ws["data"], eval={"every": 2})
    with pytest.raises(UpcyclerError, match="no held-out source .*prepare-data --heldout"):
        train(TrainConfig.from_dict(cfg))
    assert not (tmp_path / "run").exists()


def test_report_draws_the_heldout_losses_and_where_the_time_went(runs, tmp_path):
    from upcycler.train.reporting.plots import make_report

    names = {p.name for p in make_report(runs["watched"], tmp_path / "report")}
    assert {"heldout.png", "goodput.png", "loss.png"} <= names
    for name in ("heldout.png", "goodput.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mfu_is_measured_against_the_chips_published_peak_or_a_measured_one():
    from types import SimpleNamespace

    import jax

    from upcycler.hardware import chip_for
    from upcycler.train.reporting.peak import peak_per_device

    assert peak_per_device(2.5e12, jax.devices()).source == "metrics.peak_flops"
    v5e = [SimpleNamespace(device_kind="TPU v5 lite", coords=(i, 0, 0)) for i in range(4)]
    peak = peak_per_device(None, v5e)
    assert peak.flops == chip_for("TPU v5 lite").peak_bf16_flops == 197e12 and "TPU v5e" in peak.source
    v4 = [SimpleNamespace(device_kind="TPU v4", coords=(i // 2, 0, 0)) for i in range(4)]  # 2 cores a chip
    assert peak_per_device(None, v4).flops == chip_for("TPU v4").peak_bf16_flops / 2
    cpu = peak_per_device(None, jax.devices())
    assert "measured" in cpu.source and 1e8 < cpu.flops < 1e13 and "measured" in cpu.describe()
