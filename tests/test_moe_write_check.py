"""The check every exact `dense-to-moe` write runs on what it wrote (`transforms/moe_write_check.py`).

The passing side is `test_dense_to_moe.py::test_the_write_check_passes_every_exact_case` (every family,
cover and router there). Here: each bad output the end-to-end `verify` catches (`bad_variants`), written
with the writer's own per-tensor digests, is caught by the write check and named by layer; so are a
tensor in the wrong expert slot, a split virtual group, a wrong down_proj factor that the digests cannot
see (transform and check agree on it) and a config.json that changes the function. A write whose check
fails leaves nothing behind (and, through the CLI, `test_verify.py::test_a_failed_check_leaves_nothing`).
"""

from __future__ import annotations

import json

import pytest
from bad_variants import VARIANTS, write_variant
from transform_helpers import run_transform

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint, write_checkpoint
from upcycler.tensors import constant
from upcycler.transforms import dense_to_moe, moe_write_check
from upcycler.transforms.moe_write_check import write_check_for
from upcycler.transforms.pipeline import execute

LAYER = 1  # the layer each bad variant changes (of 2; MoE everywhere)
OPTIONS = {"experts": 16, "topk": 4, "granularity": 4}  # R = 4: every expert of a group holds its own window


@pytest.fixture(scope="module")
def good(tiny_dir, tmp_path_factory):
    """(source, a correct upcycle, its plan)."""
    src = tiny_dir("llama")
    out = tmp_path_factory.mktemp("good") / "moe"
    return src, out, run_transform("dense-to-moe", src, out, **OPTIONS)


def _fails(check, directory, *mentions: str) -> str:
    with pytest.raises(UpcyclerError) as caught:
        check(directory)
    text = str(caught.value)
    assert "claims to preserve the function" in text and "\n" not in text, text
    for mention in mentions:
        assert mention in text, text
    return text


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_bad_variant_is_caught_and_named_by_layer(variant, good, tmp_path):
    _, out, p = good
    bad = write_variant(out, tmp_path / "bad", variant, layer=LAYER)
    _fails(write_check_for(p), bad, f"layer {LAYER}:")


def _rewritten(out, directory, change) -> None:
    ckpt = read_checkpoint(out)
    write_checkpoint(ckpt.replace(tensors=ckpt.tensors.updated(change(ckpt))), directory, progress=False)


def test_a_tensor_in_the_wrong_expert_slot_is_named(good, tmp_path):
    _, out, p = good
    name = f"layers.{LAYER}.moe.experts.up_proj"

    def swap(ckpt):
        values = ckpt.tensors[name].load().copy()
        values[[5, 6]] = values[[6, 5]]  # members 1 and 2 of group 1 hold each other's window
        return {name: constant(values)}

    _rewritten(out, tmp_path / "bad", swap)
    _fails(write_check_for(p), tmp_path / "bad", f"layer {LAYER}: routed expert 5's up_proj")


def test_a_router_other_than_drawn_is_named(good, tmp_path):
    _, out, p = good
    name = f"layers.{LAYER}.moe.router"

    def nudge(ckpt):
        values = ckpt.tensors[name].load().copy()
        values[9, 0] = -values[9, 0] if values[9, 0] != 0 else 1
        return {name: constant(values)}

    _rewritten(out, tmp_path / "bad", nudge)
    _fails(write_check_for(p), tmp_path / "bad", f"layer {LAYER}: the router should hold the rows drawn for it")


def test_a_split_virtual_group_is_named(tiny_dir, tmp_path, monkeypatch):
    """A router whose group members differ, written as planned: the digests agree, the tie check does not."""
    src = tiny_dir("llama")
    real = dense_to_moe._router

    def split(seed, layer, groups, R, D, std, dtype):
        tensor = real(seed, layer, groups, R, D, std, dtype)
        values = tensor.load().copy()
        values[9, 0] = -values[9, 0] if values[9, 0] != 0 else 1
        return constant(values)

    monkeypatch.setattr(dense_to_moe, "_router", split)
    p = run_transform("dense-to-moe", src, tmp_path / "moe", dry_run=True, **OPTIONS)
    _fails(lambda _: execute(p, progress=False, check=write_check_for(p)), None, "layer 0:", "virtual group 2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key, value", [("rms_norm_eps", 1e-3), ("rope_theta", 5000.0),
                                        ("tie_word_embeddings", True)])
def test_a_config_that_changes_the_function_is_caught(key, value, good, tmp_path, monkeypatch):
    from upcycler.families.base import Family

    _, out, p = good
    real = Family.write_config
    monkeypatch.setattr(Family, "write_config", lambda self, spec: {**real(self, spec), key: value})
    _rewritten(out, tmp_path / "bad", lambda ckpt: {})
    _fails(write_check_for(p), tmp_path / "bad", "config.json")


def test_a_wrong_factor_the_digests_cannot_see_fails_the_probe(tiny_dir, tmp_path, monkeypatch):
    """Transform and check take the router's factor from one function: ×2 there writes and expects the same
    bytes, and only the probe against the dense MLP can tell. The failed write leaves nothing behind."""
    src = tiny_dir("llama")
    twice = lambda moe, group: 2.0 * group
    monkeypatch.setattr(dense_to_moe, "router_factor", twice)
    monkeypatch.setattr(moe_write_check, "router_factor", twice)
    p = run_transform("dense-to-moe", src, tmp_path / "moe", dry_run=True, **OPTIONS)
    text = _fails(lambda _: execute(p, progress=False, check=write_check_for(p)), None,
                  "layer 0: the MoE block's output differs from the dense MLP's")
    assert "fp32 noise floor" in text
    assert list(tmp_path.iterdir()) == []  # no output, no staging directory


def test_the_cli_checks_in_stream_by_default(tiny_dir, tmp_path):
    from cli_helpers import run_cli

    proc = run_cli("dense-to-moe", tiny_dir("llama"), tmp_path / "moe", *[f"--{k}={v}" for k, v in OPTIONS.items()])
    assert "verified: same function: every tensor holds the bytes it should" in proc.stderr, proc.stderr
    record = json.loads((tmp_path / "moe" / "upcycler.json").read_text())["verification"]
    assert record["method"] == "in-stream" and record["passed"] and record["moe_layers"] == 2


def test_a_block_that_adds_nothing_checks_in_stream(tiny_dir, tmp_path):
    """`upcycle depth` grows identity blocks (down_proj all zeros): their dense MLP outputs exactly zero, no
    noise floor at all, and the in-stream check of an MoE made from them passes (it divided by zero)."""
    from cli_helpers import run_cli

    run_cli("depth", tiny_dir("llama"), tmp_path / "deep", "--layers", "4")
    proc = run_cli("dense-to-moe", tmp_path / "deep", tmp_path / "moe", *[f"--{k}={v}" for k, v in OPTIONS.items()])
    assert "verified: same function" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    record = json.loads((tmp_path / "moe" / "upcycler.json").read_text())["verification"]
    assert record["method"] == "in-stream" and record["passed"] and record["moe_layers"] == 4


def test_bf16_exponent_arithmetic_is_the_exact_product_or_declines():
    """Scaling bf16 down_proj columns by 2^k on their bits equals the transform's fp32 product rounded to
    bf16 wherever it answers, and declines (None: the transform's own arithmetic runs instead) on a zero,
    a subnormal, an infinity or an exponent that would leave the normal range."""
    import numpy as np

    from upcycler.tensors import BF16
    from upcycler.transforms.dense_to_moe import scale_columns
    from upcycler.transforms.moe_block_stream import Buffers, _bf16_times_power_of_two

    rng = np.random.default_rng(0)
    normal = (rng.standard_normal((16, 24)) * 10.0 ** rng.integers(-30, 30, (16, 24))).astype(BF16)
    for k in (-3, -1, 1, 2, 3):
        got = _bf16_times_power_of_two(normal, k, Buffers())
        assert got is not None
        assert np.array_equal(got, scale_columns(normal, 2.0**k).view(np.uint16)), k
    tiny, huge = np.finfo(np.float32).smallest_normal, np.finfo(np.float32).max
    for bad, k in [(0.0, 1), (tiny / 4, 1), (np.inf, 1), (tiny, -1), (huge / 2, 2)]:
        values = normal.copy()
        values[3, 5] = bad
        assert _bf16_times_power_of_two(values, k, Buffers()) is None, (bad, k)
