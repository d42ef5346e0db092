"""Expert usage per data source: the train step's counts [M, S, E], `expert_load_by_source` in
metrics.jsonl, its reader checks, and `expert_usage_by_source.png` in `upcycle report`.

The tiny qwen3_moe of `trainer_fixtures` (3 layers, the first dense: 2 MoE layers of 4 experts, top-2)
on the two prepared test sources (`json`, `email`).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import trainer_fixtures as F
from xla_flags import with_devices

from upcycler.errors import UpcyclerError
from upcycler.train.config import LossConfig, ModelConfig, TrainConfig
from upcycler.train.data.mix import make_data_iterator
from upcycler.train.loop.train_step import TrainState, make_train_step
from upcycler.train.loop.trainer import train
from upcycler.train.model import hidden_states
from upcycler.train.model.params import init_params
from upcycler.train.reporting.expert_plots import usage_layers
from upcycler.train.reporting.metrics import read_metrics
from upcycler.train.reporting.metrics_log import step_record
from upcycler.train.reporting.plots import make_report
from upcycler.train.techniques.expert_window import ExpertWindow

PNG = b"\x89PNG\r\n\x1a\n"
B, L = 8, 16
SOURCES = ("json", "email")
CHANGES = {"steps": 6, "metrics.expert_load_every": 2, "checkpoint.every": 2, "checkpoint.keep": 3}


# --- the train step's counts --------------------------------------------------------------------------

def _batch() -> dict[str, jax.Array]:
    """Rows of sources 0 and 1 only (source 2 has none), with padding and one row wholly masked."""
    rng = np.random.default_rng(1)
    mask = np.ones((B, L), np.float32)
    mask[1, 10:] = 0
    mask[5, :3] = 0
    mask[6] = 0  # a masked row counts for nothing
    return {
        "inputs": jnp.asarray(rng.integers(0, F.VOCAB, (B, L)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, F.VOCAB, (B, L)), jnp.int32),
        "mask": jnp.asarray(mask),
        "source_id": jnp.asarray([0, 1, 1, 0, 0, 1, 1, 0], jnp.int32),
    }


def _expected_by_source(params, batch, spec, num_sources: int) -> np.ndarray:
    """Per MoE layer, source and expert, the token copies, counted in numpy from the router logits of
    each MoE layer's input: the top_k experts of each real token by a plain argsort, then a loop."""
    _, aux = hidden_states(params, batch["inputs"], spec, ModelConfig())
    logits = np.asarray(aux.router_logits, np.float64)  # [M, B, L, E]
    k, num_experts = spec.moe.top_k, spec.moe.num_experts
    ranked = np.sort(logits, axis=-1)
    assert (ranked[..., -k] - ranked[..., -k - 1]).min() > 1e-5, "a near tie: the choice is not well defined"
    chosen = np.argsort(-logits, axis=-1)[..., :k]
    mask, source = np.asarray(batch["mask"]), np.asarray(batch["source_id"])
    counts = np.zeros((logits.shape[0], num_sources, num_experts), np.int64)
    for m in range(logits.shape[0]):
        for b in range(B):
            for t in range(L):
                if mask[b, t]:
                    for e in chosen[m, b, t]:
                        counts[m, source[b], e] += 1
    return counts


def test_step_counts_match_routing_computed_in_numpy():
    """Two microbatches: the counts are summed over them (the one-batch step runs in `runs` below)."""
    spec = F.tiny_spec(moe=True)
    params = init_params(spec, jax.random.key(0), std=0.05)
    batch = _batch()
    tx = optax.sgd(1.0)
    step = make_train_step(spec, ModelConfig(), LossConfig(), tx, lambda s: jnp.float32(1.0), num_sources=3,
                           microbatches=2)
    _, raw = jax.jit(step)(TrainState(jnp.asarray(0, jnp.int32), params, tx.init(params)), batch)
    raw = jax.device_get(raw)
    counts = raw["expert_counts_by_source"]
    assert counts.dtype == np.int32 and counts.shape == (2, 3, 4)
    expected = _expected_by_source(params, batch, spec, num_sources=3)
    np.testing.assert_array_equal(counts, expected)
    np.testing.assert_array_equal(counts.sum(axis=1), raw["expert_counts"])  # exactly the expert load
    real_tokens = int(np.asarray(batch["mask"]).sum())
    assert counts.sum() == 2 * 2 * real_tokens  # 2 layers × top-2 copies of every real token
    assert counts[:, 2].sum() == 0 and counts[:, 0].sum() > 0 and counts[:, 1].sum() > 0

    window = ExpertWindow(spec, 0.1, ("a", "b", "c"))
    window.add(raw)
    record = step_record(0, raw, sources=("a", "b", "c"), step_time=1.0, batch_tokens=B * L,
                         flops_per_step=1.0, peak_flops=None, num_devices=1, window=window.take())
    assert record["sources"] == ["a", "b", "c"]
    shares = record["expert_load_by_source"]
    assert [layer[2] for layer in shares] == [None, None]  # no token of source c: a null row
    for m, layer in enumerate(shares):
        for s in (0, 1):
            assert sum(layer[s]) == pytest.approx(1.0, abs=1e-5)
            np.testing.assert_allclose(layer[s], expected[m, s] / expected[m, s].sum(), atol=1e-6)
    without = step_record(1, raw, sources=("a", "b", "c"), step_time=1.0, batch_tokens=B * L,
                          flops_per_step=1.0, peak_flops=None, num_devices=1, window=window.take())
    assert "expert_load_by_source" not in without and "sources" not in without  # the window was emptied


# --- training runs --------------------------------------------------------------------------------------

def _start(path, devices: int):
    """`train` of the config at `path` in a child process that sees `devices` CPU devices (the trainer
    itself, without the command line's imports)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": with_devices(devices)}
    code = ("import sys; from upcycler.train.config import load_config; "
            "from upcycler.train.loop.trainer import train; train(load_config(sys.argv[1]))")
    return subprocess.Popen([sys.executable, "-c", code, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def runs(ws, cache, tmp_path_factory):
    """The tiny MoE trained 6 steps (expert load of the windows [0, 2), [2, 4), [4, 6) on steps 1, 3, 5) on one device, on 8 fake devices
    (fsdp=4 × expert=2, a subprocess running meanwhile), and stopped at step 4 then resumed to 6."""
    root = tmp_path_factory.mktemp("usage")
    eight = F.config_dict(root / "eight", ws["moe"], ws["data"], mesh={"data": 1, "fsdp": 4, "expert": 2},
                          **CHANGES)
    proc = _start(F.write_config(root / "eight.yaml", eight), devices=8)
    one = F.config_dict(root / "one", ws["moe"], ws["data"], **CHANGES)
    train(TrainConfig.from_dict(one))
    resumed = F.config_dict(root / "resumed", ws["moe"], ws["data"], **CHANGES)
    train(TrainConfig.from_dict({**resumed, "steps": 4}))
    train(TrainConfig.from_dict(resumed), resume=True)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return {"config": one, **{name: root / name / "run" for name in ("one", "eight", "resumed")}}


def test_logged_shares_are_per_source_and_add_up_to_the_expert_load(runs):
    records = [r for r in F.metrics(runs["one"]) if "expert_load" in r]
    assert [r["step"] for r in records] == [1, 3, 5]  # each over the window of 2 steps that ends there
    assert all("expert_load_by_source" not in r for r in F.metrics(runs["one"]) if "expert_load" not in r)
    # each step's tokens per source, from the data pipeline itself (the same batches as the run)
    data = make_data_iterator(TrainConfig.from_dict(runs["config"]).data, 0, 1)
    try:
        assert data.source_names == SOURCES
        batches = [next(data) for _ in range(6)]
    finally:
        data.close()
    for r in records:
        assert r["sources"] == list(SOURCES)
        shares = np.asarray(r["expert_load_by_source"], np.float64)  # both sources have tokens every step
        assert shares.shape == (2, 2, 4)
        np.testing.assert_allclose(shares.sum(axis=2), 1.0, atol=1e-5)
        window = batches[r["step"] - 1: r["step"] + 1]
        tokens = np.array([sum(b["mask"][b["source_id"] == s].sum() for b in window) for s in range(2)],
                          np.float64)
        assert tokens.min() > 0
        # copies per expert = Σ_s share · copies of s; as a share of all copies it is the expert load
        combined = (shares * tokens[None, :, None]).sum(axis=1) / tokens.sum()
        np.testing.assert_allclose(combined, r["expert_load"], atol=2e-6)
    # not the same distribution for both sources: the field really splits by source
    assert any(np.abs(np.diff(np.asarray(r["expert_load_by_source"]), axis=1)).max() > 0.01 for r in records)


def test_eight_devices_and_a_resumed_run_log_the_same_shares(runs):
    def logged(run):
        return [(r["step"], r["sources"], r["expert_load_by_source"]) for r in F.metrics(run)
                if "expert_load_by_source" in r]

    reference = logged(runs["one"])
    assert len(reference) == 3
    assert logged(runs["eight"]) == reference
    assert logged(runs["resumed"]) == reference


def test_report_draws_usage_by_source_for_moe_runs_only(ws, cache, runs, tmp_path):
    names = [p.name for p in make_report(runs["one"], tmp_path / "moe")]
    assert "expert_usage_by_source.png" in names
    png = (tmp_path / "moe" / "expert_usage_by_source.png").read_bytes()
    assert png[:8] == PNG and len(png) > 1000
    dense = F.config_dict(tmp_path / "dense", ws["dense"], ws["data"], steps=1)
    train(TrainConfig.from_dict(dense))
    logged = F.metrics(tmp_path / "dense" / "run")
    assert logged and all("expert_load_by_source" not in r and "sources" not in r for r in logged)
    names = [p.name for p in make_report(tmp_path / "dense" / "run", tmp_path / "plots")]
    assert "loss.png" in names and "expert_usage_by_source.png" not in names


def test_report_with_many_layers_and_a_source_without_tokens(tmp_path):
    rng = np.random.default_rng(0)
    layers, experts = 30, 16
    lines = []
    for step in (0, 10, 20):
        by_source = [[rng.dirichlet(np.ones(experts)).round(6).tolist(), None] for _ in range(layers)]
        line = {**_line(step), "expert_load_by_source": by_source, "sources": ["code", "math$"]}
        del line["expert_load"]  # not 30 more PNGs to draw
        lines.append(line)
    run = _write_run(tmp_path, lines)
    assert (tmp_path / "plots" / "expert_usage_by_source.png") in make_report(run, tmp_path / "plots")
    assert (tmp_path / "plots" / "expert_usage_by_source.png").read_bytes()[:8] == PNG
    shown = usage_layers(layers)  # the panels drawn: 12, evenly spaced, first and last included
    assert len(shown) == 12 and shown[0] == 0 and shown[-1] == 29
    assert max(np.diff(shown)) - min(np.diff(shown)) <= 1
    assert usage_layers(5) == [0, 1, 2, 3, 4]


# --- the reader ------------------------------------------------------------------------------------------

def _line(step: int, **extra) -> dict:
    return {"step": step, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0,
            "expert_load": [[0.5, 0.5], [0.25, 0.75]],
            "expert_load_by_source": [[[0.5, 0.5], [1.0, 0.0]], [[0.25, 0.75], None]],
            "sources": ["code", "math"], **extra}


def _write_run(tmp_path, lines):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_a_well_formed_log_reads_back(tmp_path):
    records = read_metrics(_write_run(tmp_path, [_line(0), _line(2)]))
    assert records[1]["expert_load_by_source"][1][1] is None and records[1]["sources"] == ["code", "math"]


BAD = {
    "not a list": {"expert_load_by_source": "lots"},
    "a layer not a list": {"expert_load_by_source": [[[0.5, 0.5], [1, 0]], 3]},
    "a row that is a number": {"expert_load_by_source": [[[0.5, 0.5], 1.0], [[0.5, 0.5], None]]},
    "ragged rows": {"expert_load_by_source": [[[0.5, 0.5], [1.0]], [[0.5, 0.5], None]]},
    "a string share": {"expert_load_by_source": [[[0.5, "x"], [1, 0]], [[0.5, 0.5], None]]},
    "a share above 1": {"expert_load_by_source": [[[0.5, 1.5], [1, 0]], [[0.5, 0.5], None]]},
    "rows not matching sources": {"sources": ["code", "math", "prose"]},
    "no sources": {"sources": None},
    "sources not strings": {"sources": ["code", 7]},
    "a source named twice": {"sources": ["code", "code"]},
    "layers not matching expert_load": {"expert_load": [[0.5, 0.5]]},
    "experts not matching expert_load": {"expert_load": [[0.3, 0.3, 0.4], [0.3, 0.3, 0.4]]},
    "other sources than line 1": {"sources": ["code", "prose"]},
    "other experts than line 1": {  # a line without expert_load: only this check sees it
        "expert_load": None, "expert_load_by_source": [[[0.3, 0.3, 0.4], None], [[0.3, 0.4, 0.3], None]]},
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_expert_load_by_source_is_one_line_naming_the_line(tmp_path, case):
    second = _line(2, **BAD[case])
    second = {k: v for k, v in second.items() if v is not None}
    run = _write_run(tmp_path, [_line(0), second])
    with pytest.raises(UpcyclerError, match=r"metrics\.jsonl:2: ") as err:
        make_report(run, tmp_path / "plots")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "plots").exists()
