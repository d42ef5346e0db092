"""Expert parallelism: the all_to_all and all_gather dispatch variants against the one-device layer,
the compressed collectives' error bounds, and the collective bytes a TPU compile reports against the
volume computed here from the shapes.

The 8-device measurements run once in a child process (`expert_parallel_checks.py`, mesh data 1 × fsdp 2
× expert 4, E = 8 so two experts per device) and every test reads its part.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_compile_only import compile_report, demo  # noqa: F401  (the demo MoE as a config-only directory)

from upcycler.io.hf_read import read_spec
from upcycler.train.model import comm

HERE = Path(__file__).parent
CASES = ("random/k2", "random/k6", "empty_experts/k2", "one_expert/k3")  # k below and above the 4 devices
VARIANTS = ("all_to_all", "all_to_all_ragged", "all_gather", "all_gather_chunked")
QUANTITIES = ("y", "d_x", "d_logits", "d_w_gate_up", "d_w_down")


@pytest.fixture(scope="module")
def measured():
    proc = subprocess.run([sys.executable, str(HERE / "expert_parallel_checks.py")], capture_output=True,
                          text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", (*VARIANTS, "gspmd"))
def test_every_dispatch_equals_the_one_device_layer(measured, case, variant):
    """Outputs and the gradients of x, router logits and both expert weights, within 1e-5 relative."""
    errors = measured[f"{case}/{variant}/fp32"]
    for quantity in QUANTITIES:
        assert errors[quantity] < 1e-5, (quantity, errors)


def test_the_cases_cover_empty_experts_and_one_expert_taking_every_token(measured):
    """The routing cases are what their names say (so the equality above covers them)."""
    assert 0 in measured["empty_experts/k2/all_to_all/fp32"]["load"]
    assert measured["one_expert/k3/all_to_all/fp32"]["load"][5] == 64  # every one of the 64 tokens


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("comm_dtype", "bound"), [("bf16", 2.0**-8), ("fp8", 2.0**-4)])
def test_compressed_combine_stays_within_its_rounding_bound(measured, case, variant, comm_dtype, bound):
    """A compressed combine (and its gradients) errs by no more than one rounding of its payload, and by
    more than float32 does (the compression is really applied)."""
    errors = measured[f"{case}/{variant}/{comm_dtype}"]
    for quantity in QUANTITIES:
        assert 1e-5 < errors[quantity] <= bound, (quantity, errors)


@pytest.mark.parametrize("dispatch", ("gspmd", "all_to_all"))
def test_expert_weight_gradients_reduce_scattered_in_bf16(measured, dispatch):
    """grad_comm_dtype: the expert weights' gradient reduce-scatter over fsdp in float32 is exact; sent as
    bf16 and summed in float32 it errs by one bf16 rounding at most."""
    exact, compressed = (measured[f"grad_comm/{dispatch}/{c}"] for c in ("fp32", "bf16"))
    for name in ("d_w_gate_up", "d_w_down"):
        assert exact[name] < 1e-6
        assert 1e-5 < compressed[name] <= 2.0**-8


def test_all_to_all_then_float32_sum_beats_a_bf16_ring(measured):
    """MegaScale's scheme: the same bf16 bytes, half the error of a ring that adds in bf16 at every hop."""
    r = measured["reductions"]
    assert r["fp32"] < 1e-6
    assert r["bf16"] < 0.6 * r["bf16_ring"]
    assert r["bf16"] <= 2.0**-8 and r["fp8"] <= 2.0**-4


# ------------------------------------------------------------------------------- encoding, one device


def _rows(seed: int, shape=(64, 256)) -> np.ndarray:
    return np.array(jax.random.normal(jax.random.PRNGKey(seed), shape), np.float32)


def test_bf16_payload_rounds_each_element_once():
    x = _rows(0) * np.exp(_rows(1) * 4)  # magnitudes over many binades
    back = np.asarray(comm.round_trip(jnp.asarray(x), "bf16"))
    assert np.all(np.abs(back - x) <= 2.0**-8 * np.abs(x))


def test_fp8_payload_error_per_element():
    """≤ 2⁻⁴ relative in e4m3's normal range of the row's scale; below it, ≤ half a subnormal step."""
    x = _rows(2) * np.exp(_rows(3) * 2)
    back = np.asarray(comm.round_trip(jnp.asarray(x), "fp8"))
    scale = np.abs(x).max(axis=1, keepdims=True) / comm.FP8_MAX
    normal = np.abs(x) >= scale * 2.0**-6
    err = np.abs(back - x)
    assert normal.mean() > 0.9
    assert np.all(err[normal] <= 2.0**-4 * np.abs(x)[normal])
    assert np.all(err[~normal] <= np.broadcast_to(scale, x.shape)[~normal] * 2.0**-10 * 1.0001)


def test_zero_rows_travel_as_zeros():
    x = _rows(4)
    x[3] = 0.0
    for comm_dtype in ("bf16", "fp8"):
        back = np.asarray(comm.round_trip(jnp.asarray(x), comm_dtype))
        assert np.all(back[3] == 0.0) and np.all(np.isfinite(back))


def test_per_token_scales_beat_one_scale_for_the_tensor_on_an_outlier_row():
    """One row 10⁵ times larger: a single scale would push the other rows into e4m3's subnormals."""
    x = _rows(5)
    x[7] *= 1e5
    per_token = np.asarray(comm.round_trip(jnp.asarray(x), "fp8"))
    scale = np.abs(x).max() / comm.FP8_MAX
    per_tensor = np.asarray((jnp.asarray(x) / scale).astype(comm.FP8).astype(jnp.float32) * scale)
    ordinary = np.arange(x.shape[0]) != 7

    def rel(a):
        return np.linalg.norm(a[ordinary] - x[ordinary]) / np.linalg.norm(x[ordinary])

    assert rel(per_token) <= 2.0**-4
    assert rel(per_tensor) > 10 * rel(per_token)


def test_unknown_comm_dtype_is_refused():
    with pytest.raises(ValueError, match="comm dtype"):
        comm.encode(jnp.ones((2, 2)), "int4")


# --------------------------------------------------------------------- collective bytes on a TPU slice


def _a2a_traffic(report) -> float:
    return report["collectives"]["all-to-all"]["traffic_bytes"]


@pytest.mark.parametrize(
    ("topology", "dispatch", "comm_dtype"),
    [("v5p-8", "all_to_all", "fp32"), ("v5litepod-4", "all_to_all", "fp32"), ("v5litepod-4", "all_gather", "bf16")],
)
def test_tpu_compile_moves_the_analytic_volume(demo, topology, dispatch, comm_dtype):  # noqa: F811
    """The demo MoE (24 experts, top-6, float32) on 4 TPU chips with expert=4 (6 experts per chip): the
    all-to-all bytes the compiled step reports per chip, against the volume computed here per MoE layer,
    forward and backward, with (n−1)/n of every exchange leaving the chip:
    - all_to_all on v5p (`ragged_all_to_all`): 4 exchanges of the T·k sorted copies, T·k·D·4 bytes;
    - all_to_all on v5e (no ragged all-to-all there: padded): 4 exchanges of n·T·min(k, L) rows;
    - all_gather with a bf16 combine: the combine and the backward of the token gather, n·T·D·2 bytes."""
    config, model_dir = demo
    spec = read_spec(model_dir)
    _, report = compile_report(config, "--topology", topology, "--set", "mesh.fsdp=1", "--set", "mesh.expert=4",
                               "--set", f"model.moe_dispatch={dispatch}", "--set", f"model.comm_dtype={comm_dtype}")
    n, layers, d = 4, spec.num_layers - len(spec.dense_layers), spec.hidden_size
    k, local = spec.moe.top_k, spec.moe.num_experts // n
    tokens = 8 * 128 // report["devices"]
    if dispatch == "all_gather":
        expected = layers * 2 * n * tokens * d * 2
    elif topology.startswith("v5p"):
        expected = layers * 4 * tokens * k * d * 4
    else:
        expected = layers * 4 * n * tokens * min(k, local) * d * 4
    assert report["devices"] == n and report["mesh"]["expert"] == n
    assert _a2a_traffic(report) == pytest.approx(expected * (n - 1) / n, rel=0.1)
