"""`continued-pretrain --compile-only`: the demo's train step compiled for the local CPU, for 8 fake
devices and for a TPU v5e 2x2 slice, from a directory holding only the model's config.json and a data
directory that does not exist.

The parameter and optimiser bytes per device are checked against arithmetic done here from the declared
parameters and the sharding rule "the model width splits over fsdp when it divides" (not read back from
the report's own code), and against the compiler's argument size where the compiler is exact (CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from itertools import pairwise

import pytest
from cli_helpers import assert_clean_failure, run_cli
from xla_flags import with_devices

from upcycler.cli.demo import _train_config, demo_assets
from upcycler.io.hf_read import read_spec
from upcycler.layout import declare_params

ADAM_COUNTERS = 64  # bytes: the int32 step counters of Adam and the schedule, replicated


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's MoE as a config-only directory, and the demo's training config pointing at it."""
    root = tmp_path_factory.mktemp("compile_only")
    moe = root / "moe-full"
    run_cli("dense-to-moe", demo_assets() / "model", moe, "--experts", "24", "--topk", "6", "--granularity", "8",
            "--shared-experts", "2", "--dense-layers", "1", "--target", "qwen2_moe", "--seed", "0")
    config_only = root / "moe"
    config_only.mkdir()
    shutil.copy(moe / "config.json", config_only / "config.json")
    config = _train_config(root, config_only, 10, root / "run")
    assert not (root / "data").exists()  # compile-only needs no data
    return config, config_only


def expected_bytes(model_dir, fsdp: int) -> tuple[int, int]:
    """(fp32 parameter bytes, Adam bytes) per device when every tensor with the model-width axis is split
    over `fsdp` devices along it (when it divides) and everything else is replicated."""
    spec = read_spec(model_dir)
    params = 0
    for decl in declare_params(spec):
        split = "embed" in decl.axes and decl.shape[decl.axes.index("embed")] % fsdp == 0
        params += decl.numel // (fsdp if split else 1) * 4
    return params, 2 * params


def compile_report(config, *args, env=None, check=True):
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "upcycler", "continued-pretrain", "--config", str(config),
         "--compile-only", "--json", *map(str, args)],
        capture_output=True, text=True, timeout=900, env=full_env, check=False,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None)


def test_local_cpu_report(demo):
    config, model_dir = demo
    _, report = compile_report(config)
    params, adam = expected_bytes(model_dir, fsdp=1)
    memory = report["memory"]
    assert memory["params"] == params and memory["gradients"] == params
    assert adam <= memory["optimizer"] <= adam + ADAM_COUNTERS
    batch = 8 * 128 * 4 * 3 + 8 * 4  # inputs, targets, mask [B, L] + source_id [B]
    assert memory["batch"] == batch
    assert memory["arguments"] == memory["params"] + memory["optimizer"] + batch + 4  # + the step counter
    assert report["devices"] == 1 and report["fits"] is None  # a CPU has no HBM figure
    assert report["flops"]["per_step"] == pytest.approx(report["flops"]["per_token"] * 8 * 128)


def test_eight_fake_devices_split_the_state(demo):
    config, model_dir = demo
    _, report = compile_report(config, env={"XLA_FLAGS": with_devices(8)})
    params, adam = expected_bytes(model_dir, fsdp=8)
    memory = report["memory"]
    assert report["devices"] == 8 and report["mesh"] == {"data": 1, "fsdp": 8, "context": 1, "expert": 1}
    assert memory["params"] == params
    assert adam <= memory["optimizer"] <= adam + ADAM_COUNTERS
    assert memory["arguments"] == memory["params"] + memory["optimizer"] + memory["batch"] + 4
    assert report["collectives"]["all-gather"]["executions"] > 0  # FSDP gathers the weights


def test_v5e_2x2_report_fits_with_collectives_and_roofline(demo, tmp_path):
    pytest.importorskip("libtpu", reason="the [tpu] extra (libtpu) compiles for TPU; the test command installs it")
    config, model_dir = demo
    # a cache of its own (the run's shared one gains other workers' CPU steps meanwhile)
    proc, report = compile_report(config, "--topology", "v5e-4", "--set", "model.compute_dtype=bfloat16",
                                  "--save-bandwidth", "2GB", env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path)})
    # JAX's persistent cache keeps no TPU step: this host could not load it back
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("jit_step")]
    params, adam = expected_bytes(model_dir, fsdp=4)
    memory = report["memory"]
    assert report["target"] == "v5e-4" and report["device_kind"] == "TPU v5 lite" and report["chip"] == "TPU v5e"
    assert memory["params"] == params and adam <= memory["optimizer"] <= adam + ADAM_COUNTERS
    assert report["fits"] is True and report["budget"] == int(15.75 * 2**30)
    assert 0 < memory["peak"] < report["budget"] and report["margin"] == report["budget"] - memory["peak"]
    assert report["collectives"]["all-gather"]["traffic_bytes"] > 0
    roofline = report["roofline"]
    assert roofline["chip"] == "TPU v5e" and 0 < roofline["mfu"] < 1
    assert roofline["step_s"] == max(roofline["compute_s"], roofline["memory_s"], roofline["communication_s"])
    assert proc.stderr.strip() == ""  # libtpu stays quiet on a host without TPUs
    # the checkpoint: the whole state once (fp32 parameters and Adam's two moments), written by the slice's
    # one host at the 2 GB/s given
    whole_params, whole_adam = expected_bytes(model_dir, fsdp=1)
    save = report["save"]
    assert whole_params + whole_adam <= save["state_bytes"] <= whole_params + whole_adam + ADAM_COUNTERS
    assert save["hosts"] == 1 and save["max_host_bytes"] == save["state_bytes"]
    assert save["seconds"] == pytest.approx(save["state_bytes"] / 2e9) and save["fits_notice"] is True


def test_two_slices_report_dcn_traffic_apart(demo):
    """Multislice: 2 × v5e-4 joined by the data-center network, the demo's one-slice mesh (data 1, fsdp -1)
    taken as data 2 spanning them, fsdp 4 within each; a data size the slices do not divide refused. The compiler
    carries the data-parallel gradient reduction across slices (DCN all-reduce traffic); the FSDP weight
    gathers stay inside each slice (under 5% of the all-gather traffic crosses it: small statistics);
    the state per device is the one-slice split (fsdp 4)."""
    pytest.importorskip("libtpu", reason="the [tpu] extra (libtpu) compiles for TPU; the test command installs it")
    config, model_dir = demo
    _, report = compile_report(config, "--topology", "v5e-4", "--slices", "2", "--set", "model.compute_dtype=bfloat16")
    assert report["target"] == "2 × v5e-4" and report["slices"] == 2 and report["devices"] == 8
    assert report["mesh"] == {"data": 2, "fsdp": 4, "context": 1, "expert": 1} and report["fits"] is True
    assert report["chip"] == "TPU v5e" and report["budget"] == int(15.75 * 2**30)  # a whole chip per device
    assert report["memory"]["params"] == expected_bytes(model_dir, fsdp=4)[0]
    kinds = report["collectives"]
    gathers = kinds["all-gather"]
    assert kinds["all-reduce"]["dcn_traffic_bytes"] > 0, kinds
    assert gathers["traffic_bytes"] > 0 and gathers["dcn_traffic_bytes"] < 0.05 * gathers["traffic_bytes"], kinds
    refused = run_cli("continued-pretrain", "--config", config, "--compile-only", "--topology", "v5e-4",
                      "--slices", "2", "--set", "mesh.fsdp=8", check=False)  # data 1 spelled out
    assert_clean_failure(refused, mentions="must be a multiple of the 2 slices")
    assert_clean_failure(run_cli("continued-pretrain", "--config", config, "--compile-only", "--slices", "2",
                                 check=False), mentions="--slices needs --topology")


def test_a_step_that_cannot_fit_says_so_with_its_largest_items(demo):
    config, _ = demo
    proc = run_cli("continued-pretrain", "--config", config, "--compile-only", "--hbm-budget", "1MiB", check=False)
    assert proc.returncode == 1, proc.stderr
    fit = [line for line in proc.stdout.splitlines() if line.startswith("fit")]
    assert fit and "does not fit" in fit[0] and "of 1 MiB" in fit[0] and "largest: " in fit[0]


def test_a_step_the_tpu_compiler_cannot_fit_is_reported_not_raised(demo):
    """One v5e chip, 128 × 1024 tokens, no memory options: XLA refuses the program (RESOURCE_EXHAUSTED);
    the report says so with the compiler's figure, the analytic state and the options that cut memory."""
    pytest.importorskip("libtpu", reason="the [tpu] extra (libtpu) compiles for TPU; the test command installs it")
    config, _ = demo
    proc = run_cli("continued-pretrain", "--config", config, "--compile-only", "--topology", "v5e-1",
                   "--set", "data.seq_len=1024", "--set", "data.global_batch_size=128", check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == "", proc.stderr
    fit = next(line for line in proc.stdout.splitlines() if line.startswith("fit"))
    assert "does not fit: the compiler ran out of memory" in fit and "exceeds available HBM (15.75G)" in fit
    assert "optimizer state" in fit and "loss.ce_chunk" in fit and "data.microbatches" in fit


def test_phases_of_their_own_length_compile_the_longest(demo, tmp_path):
    """Every phase's shape is checked as the run checks it; the longest phase's step is the one compiled
    (here 4 rows of 256 tokens after 8 rows of 128, tokens per step kept)."""
    import yaml

    config, _ = demo
    raw = yaml.safe_load(config.read_text())
    raw["data"]["phases"][1].update(seq_len=256, batch="keep_tokens")
    phased = tmp_path / "phased.yaml"
    phased.write_text(yaml.safe_dump(raw))
    _, report = compile_report(phased)
    assert (report["options"]["seq_len"], report["options"]["global_batch_size"]) == (256, 4)
    assert report["memory"]["batch"] == 4 * 256 * 4 * 3 + 4 * 4
    proc, _ = compile_report(phased, env={"XLA_FLAGS": with_devices(8)}, check=False)
    assert_clean_failure(proc, mentions="data.phases[1] (4 rows of 256 tokens): data.global_batch_size 4")


def test_compile_only_options_are_checked(demo, tmp_path):
    config, _ = demo
    assert_clean_failure(run_cli("continued-pretrain", "--config", config, "--topology", "v5e-4", check=False),
                         mentions="--compile-only")
    assert_clean_failure(run_cli("continued-pretrain", "--config", config, "--compile-only", "--topology",
                                 "v5e-300", check=False), mentions="v5e-256")
    assert_clean_failure(run_cli("continued-pretrain", "--config", config, "--compile-only", "--hbm-budget",
                                 "lots", check=False), mentions="--hbm-budget")
    assert_clean_failure(run_cli("continued-pretrain", "--config", config, "--compile-only", "--save-bandwidth",
                                 "fast", check=False), mentions="--save-bandwidth")
    assert_clean_failure(run_cli("continued-pretrain", "--config", config, "--save-bandwidth", "1GB", check=False),
                         mentions="--compile-only")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("name", "libtpu_name", "chips"), [
    ("v5e-256", "v5e:16x16", 256), ("v5e-4", "v5e:2x2", 4), ("v5e-32", "v5e:4x8", 32), ("v6e-256", "v6e:16x16", 256),
    ("v5p-128", "v5p:4x4x4", 64), ("v5p-8", "v5p:2x2x1", 4), ("v4-32", "v4:2x2x4", 16), ("v5e:16x16", "v5e:16x16", 256),
    ("v5litepod-16", "v5e:4x4", 16),
])
def test_slice_names(name, libtpu_name, chips):
    from upcycler.train.aot.topology import parse_slice

    s = parse_slice(name)
    assert (s.libtpu_name, s.chips) == (libtpu_name, chips)


@pytest.mark.parametrize("name", ["v5e-300", "v5p-3", "v9-8", "v5e:16", "tpu", "v5e-0"])
def test_bad_slice_names_are_refused(name):
    from upcycler.errors import UpcyclerError
    from upcycler.train.aot.topology import parse_slice

    with pytest.raises(UpcyclerError, match="v5e-256"):
        parse_slice(name)


def test_topology_without_libtpu_says_how_to_install(monkeypatch):
    from upcycler.errors import UpcyclerError
    from upcycler.train.aot.topology import parse_slice, tpu_devices

    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu now raises ImportError
    with pytest.raises(UpcyclerError, match=r"libtpu is not installed; install .*upcycler\[tpu\]"):
        tpu_devices(parse_slice("v5e-4"))


def test_the_save_bound_counts_each_shard_once_per_writing_host():
    """On v5e-256 (64 hosts of 4 chips), no compile: a tensor split over all 256 chips is written by every
    host, 1/64 each; replicated over a data axis of 2, only the hosts of the first replica write it (1/32
    each); a replicated scalar counts once. The bound is the busiest host's bytes over the bandwidth, and
    a 30 s notice is missed once that exceeds 30 s."""
    pytest.importorskip("libtpu", reason="the [tpu] extra (libtpu) describes TPU slices; the test command installs it")
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from upcycler.train.aot.save_time import save_bound
    from upcycler.train.aot.topology import parse_slice, tpu_devices

    devices = sorted(tpu_devices(parse_slice("v5e-256")), key=lambda d: d.id)
    assert len({d.process_index for d in devices}) == 64
    weight = 1024 * 2048 * 4  # bytes of the [1024, 2048] float32 tensor

    def leaf(mesh, spec, shape=(1024, 2048)):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    flat = Mesh(np.array(devices).reshape(1, 256), ("data", "fsdp"))
    bound = save_bound([leaf(flat, P("fsdp")), leaf(flat, P(), shape=())], devices, host_bandwidth=1e9)
    assert bound.hosts == 64 and bound.state_bytes == weight + 4
    assert bound.max_host_bytes == weight // 64 + 4  # the scalar goes to device 0's host
    assert bound.seconds == pytest.approx(bound.max_host_bytes / 1e9)
    replicated = Mesh(np.array(devices).reshape(2, 128), ("data", "fsdp"))
    bound = save_bound([leaf(replicated, P(None, "fsdp"))], devices, host_bandwidth=1e3)
    assert bound.state_bytes == weight and bound.max_host_bytes == weight // 32
    assert bound.seconds == pytest.approx(weight / 32 / 1e3) and not bound.fits_notice


def test_the_roofline_counts_what_each_remat_policy_recomputes():
    """The executed FLOPs the roofline divides by: the model's plus the forward work each policy does
    again, from nothing (none) to the whole forward pass of every layer (full), ordered as the policies
    keep less; offloading keeps the same set, so it recomputes the same."""
    from trainer_fixtures import tiny_spec

    from upcycler.train.aot.compile_report import executed_flops_per_token
    from upcycler.train.config import REMAT_POLICIES, LossConfig, ModelConfig
    from upcycler.train.reporting.flops import flops_per_token, matmul_params

    spec = tiny_spec(moe=True)
    seq, loss = 256, LossConfig(ce_chunk=0)
    flops = {p: executed_flops_per_token(spec, seq, ModelConfig(remat=p), loss) - flops_per_token(spec, seq)
             for p in REMAT_POLICIES}
    attention = 2 * spec.num_layers * spec.num_heads * spec.head_dim * seq
    assert flops["none"] == 0 and flops["dots"] == attention
    assert flops["full"] == 2 * (matmul_params(spec) - spec.vocab_size * spec.hidden_size) + attention
    ladder = ["none", "all_but_ffn_hidden", "attention_and_ffn_input", "attention", "qkv", "full"]
    assert all(flops[a] < flops[b] for a, b in pairwise(ladder)), flops
    assert flops["offload_attention"] == flops["attention"]
    assert flops["offload_attention_and_ffn_input"] == flops["attention_and_ffn_input"]
