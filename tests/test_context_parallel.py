"""Context parallelism: every sequence split along its length over `mesh.context` devices.

The equality checks run once in a child process on 8 fake CPU devices (`context_parallel_checks.py`):
context 4 × FSDP 2 (and context 4 × expert 2, context 2 × FSDP 4 for the splash kernel) against one
device, for a dense model, sliding-window layers, the MoE's dropless and expert-parallel dispatches,
packed documents, and the splash kernel in the interpreter with either exchange of keys and values
(gathered whole, or passed around a ring of four). The balanced order itself is tested here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from upcycler.errors import UpcyclerError
from upcycler.train.loop import context_parallel

HERE = Path(__file__).parent
GRAD_TOLERANCE = 1e-5  # fp32: the same sums in another order


@pytest.fixture(scope="module")
def measured() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(HERE / "context_parallel_checks.py")], env=env, capture_output=True,
                         check=False,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["dense", "dense_sliding_window", "dense_dot_product", "moe_dropless",
                                  "moe_expert_parallel", "splash_sliding_window", "splash_ring_sliding_window"])
def test_split_sequences_equal_one_device(measured, case):
    got = measured[case]
    one, split = got["loss"]
    assert abs(one - split) <= 1e-6 * abs(one)
    assert got["grad_rel_error"] <= GRAD_TOLERANCE, got
    assert got["grads"] >= 9  # every parameter compared, not a subset
    for name, (a, b) in got["metrics"].items():
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-6), (name, a, b)
    assert all(got["integer_equal"].values()), got["integer_equal"]
    assert got["input_spec"][1] == "context", got  # the sequence really is split


def test_moe_cases_compare_the_expert_counts(measured):
    assert set(measured["moe_dropless"]["integer_equal"]) == {"expert_counts", "expert_counts_by_source"}
    assert measured["moe_expert_parallel"]["mesh"]["expert"] == 2


@pytest.mark.parametrize("case", ["packed", "packed_splash_ring"])
def test_packed_documents_stay_apart_on_a_split_sequence(measured, case):
    got = measured[case]
    assert got["rel_error"] <= 1e-5
    assert got["second_document_differs_without_segments"] > 1e-3  # the segments matter to this case


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_balanced_order_gives_each_device_equal_causal_work(degree):
    length = 16 * degree
    order = context_parallel.balanced_order(length, degree)
    assert sorted(order.tolist()) == list(range(length))
    blocks = order.reshape(degree, -1)
    chunk = length // (2 * degree)
    for i, block in enumerate(blocks):  # device i: chunks i and 2·degree − 1 − i
        assert block[:chunk].tolist() == list(range(i * chunk, (i + 1) * chunk))
        assert block[chunk:].tolist() == list(range((2 * degree - 1 - i) * chunk, (2 * degree - i) * chunk))
    work = [int((block[:, None] >= np.arange(length)[None]).sum()) for block in blocks]  # causal pairs
    assert len(set(work)) == 1
    contiguous = [int((block[:, None] >= np.arange(length)[None]).sum())
                  for block in np.arange(length).reshape(degree, -1)]
    assert max(contiguous) > 2 * min(contiguous)  # what the reordering saves


def test_device_order_round_trips_and_moves_rows_together():
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(0, 9, (3, 24)), "mask": rng.random((3, 24)), "source_id": np.arange(3)}
    held = context_parallel.to_device_order(batch, 3)
    assert np.array_equal(held["source_id"], batch["source_id"])
    order = context_parallel.balanced_order(24, 3)
    assert np.array_equal(held["inputs"], batch["inputs"][:, order])
    assert np.array_equal(held["mask"], batch["mask"][:, order])
    assert np.array_equal(context_parallel.from_device_order(held["inputs"], 3), batch["inputs"])
    assert context_parallel.to_device_order(batch, 1)["inputs"] is batch["inputs"]


def test_a_length_that_does_not_split_into_balanced_chunks_is_refused():
    with pytest.raises(UpcyclerError, match=r"data.seq_len 100 .* 8 equal chunks .* multiple of 8"):
        context_parallel.check_length(100, 4)
    context_parallel.check_length(100, 1)


def _long_config(context: int = 1):
    from upcycler.train.config import TrainConfig

    return TrainConfig.from_dict({
        "run_dir": "runs/x", "steps": 1,
        "model": {"init": "bench/configs/models/llama3-8b-40-layers", "attention": "splash",
                  "compute_dtype": "bfloat16", "weights_dtype": "bfloat16"},
        "data": {"dir": "data", "seq_len": 32768, "global_batch_size": 128, "phases": [{"weights": {"web": 1.0}}]},
        "mesh": {"data": 1, "fsdp": -1, "context": context, "expert": 1},
    }, "test")


def test_plan_searches_the_context_degree_smallest_first(monkeypatch):
    """With compiles faked (a peak that halves with each doubling of the degree, fitting from 4 up), the
    plan tries 1, 2 and 4, then 8 once (4 fitted below the ceiling), and no further; the best is 4."""
    from upcycler.train.aot import plan as plan_lib
    from upcycler.train.aot.compile import model_spec

    spec = model_spec(Path(__file__).parents[1] / "bench/configs/models/llama3-8b-40-layers")
    tried = []

    def fake_compile(config, topology, chip, spec):
        degree = config.mesh.context
        tried.append(degree)
        peak = int(40 * 2**30 / degree)
        return plan_lib.Figures(peak, 1e12, 1e10, 0.70 - 0.01 * degree, 1.0, "compute", 0.0, None)

    monkeypatch.setattr(plan_lib, "_compile", fake_compile)
    found = plan_lib.plan(_long_config(), "v5e-256", policies=("full",), microbatches=(1,), dispatch=("gspmd",),
                          spec=spec, exchange=("gather",))
    assert tried == [1, 2, 4, 8]
    assert found.best.choice.context == 4 and "mesh.context=4" in found.best.choice.sets()
    assert plan_lib.context_degrees(_long_config(2), 256) == [2, 4, 8, 16]
    assert plan_lib.context_degrees(_long_config(), 256, wanted=(8, 3)) == [8]  # 3 does not divide the chips


def test_plan_measures_both_exchanges_and_keeps_the_one_that_wins(monkeypatch):
    """Faked compiles: the ring holds less than the gather (no chip keeps the whole sequence's keys and
    values), so at degree 2 only the ring fits, and its bound beats degree 4's. Both exchanges are compiled
    at each split degree (none when the sequence is whole), and the winner's config names the ring."""
    from upcycler.train.aot import plan as plan_lib
    from upcycler.train.aot.compile import model_spec

    spec = model_spec(Path(__file__).parents[1] / "bench/configs/models/llama3-8b-40-layers")
    tried = []

    def fake_compile(config, topology, chip, spec):
        degree, exchange = config.mesh.context, config.model.context_exchange
        tried.append((degree, exchange))
        ring = exchange == "ring"
        peak = int(40 * 2**30 / degree * (0.6 if ring else 1.0))
        return plan_lib.Figures(peak, 1.6e12 if ring else 1e12, 1e10, 0.70 - 0.01 * degree, 1.0, "compute", 0.0,
                                None)

    monkeypatch.setattr(plan_lib, "_compile", fake_compile)
    found = plan_lib.plan(_long_config(), "v5e-256", policies=("full",), microbatches=(1,), dispatch=("gspmd",),
                          spec=spec)
    assert tried == [(1, "gather"), (2, "gather"), (2, "ring"), (4, "gather"), (4, "ring")]
    assert (found.best.choice.context, found.best.choice.exchange) == (2, "ring")
    assert "model.context_exchange=ring" in found.best.choice.sets()
    assert plan_lib.exchanges("splash", 1) == ["gather"] and plan_lib.exchanges("dot_product", 4) == ["gather"]
    # at degree 4 both fit at the same bound: the gather, moving fewer bytes, ranks above the smaller ring
    at_4 = [o.choice.exchange for o in found.outcomes if o.choice.context == 4]
    assert at_4 == ["gather", "ring"]


def test_a_compile_that_does_not_fit_names_the_context_degree_that_would():
    """The estimate: the state stays, the activations and work buffers split with the sequence."""
    from dataclasses import replace

    from upcycler.train.aot.compile_report import Memory, Report

    gib = 2**30
    memory = Memory(params=gib // 4, optimizer=gib // 2, gradients=gib // 4, batch=0, arguments=gib, outputs=gib,
                    aliased=gib, temporaries=16 * gib, code=0, peak=17 * gib)  # working 16 GiB
    report = Report(target="v5e-256", devices=256, device_kind="TPU v5 lite", chip="TPU v5e",
                    mesh={"data": 1, "fsdp": 256, "context": 1, "expert": 1}, model={}, options={"seq_len": 32768},
                    memory=memory, budget=int(15.75 * gib), fits=False, failure=None, flops={}, collectives={},
                    unknown_loops=(), roofline=None, compile_seconds=0.0)
    assert report.context_that_fits() == 2  # 16 / 2 = 8 GiB of 14.75 left beside the state
    assert replace(report, options={"seq_len": 32768 + 128}).context_that_fits() is None  # no 4 equal tiles
    assert replace(report, fits=True).context_that_fits() is None
    assert json.loads(report.to_json())["context_that_fits"] == 2
