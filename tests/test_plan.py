"""`continued-pretrain --compile-only --plan`: the best configuration that fits, and the YAML that runs it.

The search's rules are checked on made-up compile figures (no compiler): which candidates it compiles,
which it skips and which wins. Then the real thing on the demo MoE for a v5e-4 slice: a plan whose margin
leaves the plain step out picks a configuration that fits, the YAML it writes compiles to the figures the
plan printed, and a second plan compiles nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from upcycler.cli.demo import _train_config, demo_assets
from upcycler.train.aot import plan as plan_lib
from upcycler.train.aot.plan import Choice, Figures
from upcycler.train.config import load_config

pytest.importorskip("libtpu", reason="the [tpu] extra (libtpu) compiles for TPU; the test command installs it")
SEQ, BATCH = 256, 16


@pytest.fixture(scope="module")
def demo_moe(tmp_path_factory):
    """(training config of the demo's MoE at SEQ × BATCH tokens, a HOME for the plan's cache)."""
    root = tmp_path_factory.mktemp("plan")
    moe = root / "moe"
    proc = subprocess.run([sys.executable, "-m", "upcycler", "dense-to-moe", str(demo_assets() / "model"), str(moe),
                           "--experts", "24", "--topk", "6", "--granularity", "8", "--shared-experts", "2",
                           "--dense-layers", "1", "--target", "qwen2_moe", "--seed", "0"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = _train_config(root, moe, 10, root / "run")
    raw = yaml.safe_load(path.read_text())
    raw["data"].update(seq_len=SEQ, global_batch_size=BATCH)
    path.write_text(yaml.safe_dump(raw))
    home = root / "home"
    home.mkdir()
    return path, home


def _upcycle(*args, home, check=True):
    proc = subprocess.run([sys.executable, "-m", "upcycler", "continued-pretrain", *map(str, args)],
                          capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "HOME": str(home)})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _last_json(proc) -> dict:
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_search_compiles_what_can_win_and_picks_the_best_that_fits(demo_moe, monkeypatch):
    """Made-up figures: with no remat the step needs 4 microbatches, keeping the attention needs 2, full
    remat fits in 1. The walk compiles none at 8 (the most: it fits), then bisects 2 (no) and 4 (fits);
    attention at 2 (the most below 4: fits) and 1 (no); full only at 1 (below 2), and nothing after full
    fits at 1. The best is the highest bound that fits."""
    fits_at = {"none": 4, "attention": 2, "full": 1}
    mfu = {("none", 4): 0.40, ("attention", 2): 0.55, ("full", 1): 0.50}
    compiled = []

    def fake_compile(config, topology, chip, spec):
        key = (config.model.remat, config.data.microbatches)
        compiled.append(key)
        fits = key[1] >= fits_at[key[0]]
        return Figures(10 << 30 if fits else 20 << 30, 1e9, 1e8, mfu.get(key, 0.3) if fits else 0.0, 1.0,
                       "compute", 0.0, None)

    monkeypatch.setattr(plan_lib, "_compile", fake_compile)
    config = load_config(demo_moe[0])
    found = plan_lib.plan(config, "v5e-4", policies=("full", "attention", "none"), microbatches=(1, 2, 4, 8))
    assert compiled == [("none", 8), ("none", 2), ("none", 4), ("attention", 2), ("attention", 1), ("full", 1)]
    assert found.compiles == 6 and found.best.choice == Choice("attention", 2, "gspmd", 1, "splash")
    assert [o.mfu for o in found.outcomes if o.fits] == [0.55, 0.50, 0.40, 0.30]  # none at 8: 0.30
    # a policy whose compute-bound ceiling cannot beat the best found is not compiled at all
    compiled.clear()
    monkeypatch.setattr(plan_lib, "_ceiling", lambda config, spec, policy: {"none": 1.0, "attention": 0.9,
                                                                             "full": 0.35}[policy])
    found = plan_lib.plan(config, "v5e-4", policies=("full", "attention", "none"), microbatches=(1, 2, 4, 8))
    assert compiled == [("none", 8), ("none", 2), ("none", 4), ("attention", 2), ("attention", 1)]
    assert found.best.choice.remat == "attention"


def test_a_memory_bound_fit_lets_more_recomputation_try_the_same_count(demo_moe, monkeypatch):
    """Made-up figures of the reference MoE's shape: keeping the attention fits at 1 microbatch but is
    memory-bound; recomputing the projections (`qkv`) also fits at 1 and moves fewer bytes. A
    compute-bound fit at 1 would end the walk; a memory-bound one lets `qkv` try 1 too, and it wins."""
    bound = {"attention": "memory", "qkv": "memory"}
    mfu = {"attention": 0.646, "qkv": 0.651}
    compiled = []

    def fake_compile(config, topology, chip, spec):
        key = (config.model.remat, config.data.microbatches)
        compiled.append(key)
        return Figures(10 << 30, 1e9, 1e8, mfu[key[0]] - 0.01 * (key[1] - 1), 1.0, bound[key[0]], 0.0, None)

    monkeypatch.setattr(plan_lib, "_compile", fake_compile)
    monkeypatch.setattr(plan_lib, "_ceiling", lambda config, spec, policy: 1.0)
    config = load_config(demo_moe[0])
    found = plan_lib.plan(config, "v5e-4", policies=("qkv", "attention"), microbatches=(1, 2))
    assert compiled == [("attention", 2), ("attention", 1), ("qkv", 1)]
    assert found.best.choice.remat == "qkv" and found.best.mfu == 0.651
    # the same walk with compute-bound figures stops after `attention` at 1
    compiled.clear()
    bound.update(attention="compute")
    found = plan_lib.plan(config, "v5e-4", policies=("qkv", "attention"), microbatches=(1, 2))
    assert compiled == [("attention", 2), ("attention", 1)] and found.best.choice.remat == "attention"


def test_the_plan_fits_its_yaml_compiles_to_the_same_figures_and_it_is_cached(demo_moe, tmp_path):
    config, home = demo_moe
    narrow = ("--plan-remat", "none,attention,full", "--plan-microbatches", "1,2")
    loose = _last_json(_upcycle("--config", config, "--compile-only", "--topology", "v5e-4", "--plan",
                                tmp_path / "loose.yaml", *narrow, "--json", home=home))
    # with a 1 GiB margin no remat fits at 2 microbatches and at 1; later policies are tried only at 1, and only
    # when the best so far is memory-bound (recomputing may then move fewer bytes)
    def choices(found):
        return [(o["choice"]["remat"], o["choice"]["microbatches"]) for o in found["outcomes"]]

    tried = choices(loose)
    plain = loose["outcomes"][tried.index(("none", 1))]
    assert plain["fits"] and ("none", 2) in tried and loose["compiles"] == len(tried)
    assert set(tried) <= {("none", 2), ("none", 1), ("attention", 1), ("full", 1)}
    assert (len(tried) > 2) == (plain["bound"] == "memory")
    assert loose["best"]["mfu"] == max(o["mfu"] for o in loose["outcomes"] if o["fits"])
    assert plain["choice"]["attention"] == "splash"  # a TPU target, 256 tokens: the scores stay on chip
    margin = loose["budget"] - plain["peak"] + (1 << 20)  # the plain step misses this margin by 1 MiB
    out = tmp_path / "planned.yaml"
    tight = _upcycle("--config", config, "--compile-only", "--topology", "v5e-4", "--plan", out, *narrow,
                     "--plan-margin", str(margin), "--json", home=home)
    plan = _last_json(tight)
    best = plan["best"]
    assert best is not None and best["fits"] and best["peak"] <= plan["budget"] - margin
    assert (best["choice"]["remat"], best["choice"]["microbatches"]) != ("none", 1)
    assert all(o["mfu"] <= best["mfu"] for o in plan["outcomes"] if o["fits"])
    assert not next(o["fits"] for o in plan["outcomes"] if o["choice"]["remat"] == "none"
                    and o["choice"]["microbatches"] == 1)
    cached = set(choices(plan)) & set(tried)  # what the first plan compiled comes from the cache
    assert {("none", 1), ("none", 2)} <= cached and plan["compiles"] == len(plan["outcomes"]) - len(cached)
    # the YAML is a config the trainer loads, with the winning options; compiled, it gives the plan's figures
    written = load_config(out)
    assert (written.model.remat, written.data.microbatches, written.model.attention) == (
        best["choice"]["remat"], best["choice"]["microbatches"], "splash")
    full = _last_json(_upcycle("--config", out, "--compile-only", "--topology", "v5e-4", "--json", home=home))
    assert full["fits"] is True and full["memory"]["peak"] == best["peak"]
    assert full["roofline"]["mfu"] == pytest.approx(best["mfu"], rel=1e-9)
    assert sum(k["traffic_bytes"] for k in full["collectives"].values()) == pytest.approx(best["traffic_bytes"])
    assert "best: --set model.remat=" in _upcycle("--config", config, "--compile-only", "--topology", "v5e-4",
                                                  "--plan", tmp_path / "again.yaml", *narrow, "--plan-margin",
                                                  str(margin), home=home).stdout
    again = _last_json(_upcycle("--config", config, "--compile-only", "--topology", "v5e-4", "--plan",
                                tmp_path / "again.yaml", *narrow, "--plan-margin", str(margin), "--json", home=home))
    assert again["compiles"] == 0 and again["best"] == best


@pytest.mark.parametrize("args,message", [
    (("--compile-only",), "--topology"),
    (("--compile-only", "--topology", "v5e-4", "--plan-remat", "most"), "--plan-remat: 'most'; choose from none"),
    (("--compile-only", "--topology", "v5e-4", "--plan-microbatches", "2,x"), "--plan-microbatches takes positive"),
], ids=["no-topology", "unknown-policy", "bad-microbatches"])
def test_plan_refuses_what_it_cannot_search(demo_moe, tmp_path, args, message):
    config, home = demo_moe
    proc = _upcycle("--config", config, "--plan", tmp_path / "p.yaml", *args, home=home, check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("where,message", [
    ("missing/best.yaml", "/missing does not exist; create it or name a YAML file in an existing directory"),
    ("gs://bucket/best.yaml", "--plan: 'gs://bucket/best.yaml': gs:// locations are not supported here"),
    (".", "a directory, not a file"),
], ids=["missing-directory", "bucket", "directory"])
def test_the_plans_file_is_checked_before_anything_compiles(demo_moe, tmp_path, where, message):
    """A `--plan` destination the YAML could not be written to is refused in one line, at once (no compile:
    within seconds, and no figure cached)."""
    import time

    config, home = demo_moe
    destination = where if "://" in where else str(tmp_path / where)
    started = time.monotonic()
    proc = _upcycle("--config", config, "--compile-only", "--topology", "v5e-4", "--plan", destination,
                    home=home, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and time.monotonic() - started < 60
    assert "compiling" not in proc.stderr and sorted(tmp_path.iterdir()) == []


def test_counts_the_mesh_refuses_are_skipped_not_taken_for_out_of_memory(demo_moe, monkeypatch):
    """A microbatch count the batch cannot be split into (refused before compiling) moves the search to
    the next count down; the policy is still tried."""
    from upcycler.errors import UpcyclerError

    tried = []

    def fake_compile(config, topology, chip, spec):
        tried.append(config.data.microbatches)
        if config.data.microbatches == 8:
            raise UpcyclerError("data.global_batch_size is not divisible by the mesh × data.microbatches 8")
        fits = config.data.microbatches >= 2
        mfu = 0.8 / config.data.microbatches if fits else 0.0  # more microbatches, more weight gathers
        return Figures(10 << 30 if fits else 20 << 30, 1e9, 1e8, mfu, 1.0, "memory", 0.0, None)

    monkeypatch.setattr(plan_lib, "_compile", fake_compile)
    found = plan_lib.plan(load_config(demo_moe[0]), "v5e-4", policies=("none",), microbatches=(1, 2, 4, 8))
    assert tried == [8, 4, 2, 1] and found.best.choice.microbatches == 2
    assert [(o.choice.microbatches, o.fits) for o in found.outcomes] == [(2, True), (4, True), (1, False)]


def test_the_shape_advisor_proposes_a_shape_whose_lines_run(demo_moe, tmp_path):
    """`dense-to-moe SRC --plan-for v5e-4 --topk 2`, the source's active parameters: one proposal (16
    experts of width F/2), planned on the training run given (narrowed to one configuration: one compile),
    that fits; its upcycle line, pasted, writes that shape. Nothing is written by the advice itself."""
    from upcycler.io.hf_read import read_spec

    config, home = demo_moe
    source = demo_assets() / "model"
    spec = read_spec(source)
    proc = subprocess.run([sys.executable, "-m", "upcycler", "dense-to-moe", str(source), "--plan-for", "v5e-4",
                           "--topk", "2", "--train-config", str(config), "--plan-remat", "none",
                           "--plan-microbatches", "1", "--json"],
                          capture_output=True, text=True, timeout=900, check=False, env={**os.environ, "HOME": str(home)},
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []
    [proposal] = json.loads(proc.stdout.splitlines()[-1])["proposals"]
    assert (proposal["experts"], proposal["topk"], proposal["width"]) == (16, 2, spec.intermediate_size // 2)
    assert proposal["fits"] and proposal["mfu"] > 0 and "model.attention=splash" in proposal["sets"]
    assert proposal["compiles"] == 1 and {"model.remat=none", "data.microbatches=1"} <= set(proposal["sets"])
    out = tmp_path / "moe"
    line = proposal["upcycle"].split()
    assert line[:4] == ["upcycle", "dense-to-moe", str(source), "OUT"]
    made = subprocess.run([sys.executable, "-m", "upcycler", "dense-to-moe", str(source), str(out), *line[4:]],
                          capture_output=True, text=True, timeout=600, check=False)
    assert made.returncode == 0, made.stderr[-2000:]
    written = read_spec(out)
    assert (written.moe.num_experts, written.moe.top_k, written.moe.expert_width) == (16, 2, proposal["width"])
    assert (written.total_params(), written.active_params()) == (proposal["total_params"], proposal["active_params"])
    router = 16 * spec.hidden_size * spec.num_layers
    assert written.active_params() == spec.active_params() + router  # top-2 × F/2: the dense MLP, and a router


def test_the_advisor_plans_a_long_sequence_split_over_chips(monkeypatch, capsys, tmp_path):
    """`--plan-seq-len 32768` on a v5e-256 (compiles faked: one chip holds 8k tokens of a sequence): the
    run keeps the default's tokens per chip (256 × 4 × 4096 = 128 sequences of 32k) and each proposal
    names the context degree that fits, 4."""
    from upcycler.cli import moe_advice

    planned = []

    def fake_compile(config, topology, chip, spec):
        planned.append((config.data.seq_len, config.data.global_batch_size, config.mesh.context))
        fits = config.data.seq_len // config.mesh.context <= 8192
        return Figures(10 << 30 if fits else 20 << 30, 1e12, 1e10, 0.6 if fits else 0.0, 1.0, "compute", 0.0, None)

    monkeypatch.setattr(plan_lib, "_compile", fake_compile)
    monkeypatch.setenv("HOME", str(tmp_path))  # an empty plan cache
    moe_advice.advise(demo_assets() / "model", "v5e-256", active=None, total=None, train_config=None,
                      margin=1 << 30, as_json=True, fixed={"experts": 16, "topk": 2, "width": None}, seq_len=32768)
    [proposal] = json.loads(capsys.readouterr().out.splitlines()[-1])["proposals"]
    assert {(s, b) for s, b, _ in planned} == {(32768, 128)}
    assert list(dict.fromkeys(c for _, _, c in planned))[:3] == [1, 2, 4]  # the smallest degrees first
    assert proposal["fits"] and "mesh.context=4" in proposal["sets"]


@pytest.mark.parametrize("args,message", [
    (("OUT", "--plan-for", "v5e-4"), "--plan-for writes nothing"),
    (("--plan-for", "v5e-4", "--active-params", "lots"), "--active-params: 'lots' is not a count"),
    (("--plan-for", "v5e-4", "--active-params", "10"), "is not above the source's parameters outside its MLPs"),
    (("--plan-for", "v5e-4", "--active-params", "2.3B"), "is above what this source can make active: at most"),
    (("--plan-for", "v5e-4", "--topk", "2", "--expert-width", "128"), "no exact MoE shape meets these targets"),
    (("--plan-for", "v99-8"), "--plan-for 'v99-8': not a TPU slice"),
    (("--plan-for", "v5e-4", "--plan-seq-len", "32768", "--train-config", "OUT"), "drop one of them"),
    (("--plan-for", "v5e-4", "--plan-seq-len", "12"), "--plan-seq-len"),
    (("--plan-for", "v5e-4", "--plan-remat", "most"), "--plan-remat: 'most'; choose from none"),
    (("--plan-for", "v5e-4", "--plan-microbatches", "0"), "--plan-microbatches takes positive integers"),
    (("OUT", "--experts", "4", "--topk", "2", "--plan-remat", "full"), "it needs --plan-for"),
    (("OUT", "--experts", "4", "--topk", "2", "--plan-seq-len", "32768"), "it needs --plan-for"),
], ids=["with-out", "bad-count", "too-few", "too-many", "narrow", "bad-slice", "seq-len-and-config", "short-seq-len",
        "bad-remat", "bad-microbatches", "remat-alone", "seq-len-alone"])
def test_the_advisor_refuses_what_it_cannot_plan(tmp_path, args, message):
    args = [str(tmp_path / a) if a == "OUT" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "upcycler", "dense-to-moe", str(demo_assets() / "model"), *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "OUT").exists()
