"""Collective traffic read from compiled HLO: replica-group forms, shapes, loops and async pairs on a
hand-written module, and an FSDP scan compiled for 8 CPU devices (a subprocess, since the fake device count
must be set before JAX starts) and for TPU slices from libtpu's topology.

Expected values are worked out here from the shapes, never by the code under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from xla_flags import with_devices

from upcycler.train.aot.collectives import KINDS, collective_traffic, group_size, shape_bytes

LAYERS, WIDTH = 5, 64


def fsdp_hlo(devices, dtype: str) -> str:
    """Optimised HLO of a scan over LAYERS layers whose [WIDTH, WIDTH] weights are sharded over `devices`
    (FSDP) and gathered whole in each step: a different slice of the stacked weights per step, so XLA
    cannot hoist the gather out of the loop."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("fsdp",))

    def forward(ws, x):
        def layer(h, w):
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
            return jnp.tanh(h @ w), None

        return jax.lax.scan(layer, x, ws)[0]

    jitted = jax.jit(
        forward,
        in_shardings=(NamedSharding(mesh, P(None, "fsdp", None)), NamedSharding(mesh, P("fsdp", None))),
        out_shardings=NamedSharding(mesh, P("fsdp", None)),
    )
    ws = jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.dtype(dtype))
    x = jax.ShapeDtypeStruct((2 * len(devices), WIDTH), jnp.dtype(dtype))
    return jitted.lower(ws, x).compile().as_text()


def tpu_devices_of(slice_name: str) -> list:
    """The devices of a TPU slice as libtpu describes them; skips without libtpu."""
    pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")
    # no chip is opened, so another process holding libtpu at the same time is no conflict
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from upcycler.train.aot.topology import parse_slice, tpu_devices

    return tpu_devices(parse_slice(slice_name))


def assert_gathered_per_layer(hlo: str, devices: int, itemsize: int) -> None:
    """One all-gather of a whole [WIDTH, WIDTH] weight, run once per layer; nothing else."""
    traffic = collective_traffic(hlo)
    gather = traffic.kinds["all-gather"]
    layer_bytes = WIDTH * WIDTH * itemsize
    assert (gather.ops, gather.executions) == (1, LAYERS)
    assert gather.bytes == LAYERS * layer_bytes
    assert gather.traffic_bytes == pytest.approx(LAYERS * layer_bytes * (devices - 1) / devices)
    assert traffic.unknown_loops == ()
    assert [k for k in KINDS if traffic.kinds[k].ops] == ["all-gather"]


def test_group_size_forms():
    assert group_size("channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}") == 2
    assert group_size("replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add") == 4
    assert group_size("replica_groups=[64,4]<=[256], dimensions={0}") == 4
    assert group_size("replica_groups=[4,64]<=[64,4]T(1,0), dimensions={0}") == 64
    assert group_size("replica_groups=mesh['axis_0'=1,'axis_1'=8,'axis_2'=1] {'axis_1'}, dimensions={1}") == 8
    both = "replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_0','axis_1'}, to_apply=%add"
    assert group_size(both) == 8
    ordered = "replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1], device_ids=([4,2]T(1,0)) {'axis_1'}"
    assert group_size(ordered) == 4
    assert group_size("replica_groups=mesh['x'=16] {'x':(2)4}") == 4  # a sub-axis of size 4
    assert group_size("replica_groups={}, to_apply=%add", devices=8) == 8
    assert group_size("channel_id=1, to_apply=%add", devices=16) == 16


def test_shape_bytes():
    assert shape_bytes("bf16[4,128]{1,0:T(8,128)(2,1)S(1)}") == 4 * 128 * 2
    assert shape_bytes("f32[]") == 4
    assert shape_bytes("(f32[2,3]{1,0}, /*index=1*/s8[10]{0}, pred[4])") == 24 + 10 + 4
    assert shape_bytes("f32[<=6]") == 24
    assert shape_bytes("s4[3]") == 2


# Outer loop: TPU style, no trip count printed; its counter starts at copy(0), steps by 2, runs while
# 10 > k: 5 times. Inner loop: CPU style, known_trip_count 3, inside the outer body: 15 runs.
# The last loop's condition compares two loop values: its trip count is unknown.
MODULE = """\
HloModule toy, is_scheduled=true, entry_computation_layout={(bf16[16,32]{1,0})->f32[]}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_ar (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %ar = f32[16]{0} all-reduce(%p), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
}

%rs_wrapped (q: bf16[64,32]) -> bf16[16,32] {
  %q = bf16[64,32]{1,0} parameter(0)
  ROOT %rs = bf16[16,32]{1,0} reduce-scatter(%q), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, \
dimensions={0}, to_apply=%add
}

%inner_body (ip: (s32[], f32[16])) -> (s32[], f32[16]) {
  %ip = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%ip), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %v = f32[16]{0} get-tuple-element(%ip), index=1
  %f = f32[16]{0} fusion(%v), kind=kLoop, calls=%fused_ar
  ROOT %t = (s32[], f32[16]{0}) tuple(%next, %f)
}

%inner_cond (ic: (s32[], f32[16])) -> pred[] {
  %ic = (s32[], f32[16]{0}) parameter(0)
  %j = s32[] get-tuple-element(%ic), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}

%outer_body (op: (s32[], bf16[16,32], f32[16])) -> (s32[], bf16[16,32], f32[16]) {
  %op = (s32[], bf16[16,32]{1,0}, f32[16]{0}) parameter(0)
  %k = s32[] get-tuple-element(%op), index=0
  %two = s32[] constant(2)
  %k2 = s32[]{:T(128)} add(%k, %two)
  %w = bf16[16,32]{1,0} get-tuple-element(%op), index=1
  %ags = (bf16[8,32]{1,0}, bf16[32,32]{1,0}) all-gather-start(%w), channel_id=1, \
replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, dimensions={0}, use_global_device_ids=true
  %agd = bf16[32,32]{1,0} all-gather-done(%ags)
  %cat = bf16[64,32]{1,0} concatenate(%agd, %agd), dimensions={0}
  %rss = ((bf16[64,32]{1,0}), bf16[16,32]{1,0}) async-start(%cat), calls=%rs_wrapped
  %rsd = bf16[16,32]{1,0} async-done(%rss), calls=%rs_wrapped
  %v0 = f32[16]{0} get-tuple-element(%op), index=2
  %zero = s32[] constant(0)
  %it = (s32[], f32[16]{0}) tuple(%zero, %v0)
  %inner = (s32[], f32[16]{0}) while(%it), condition=%inner_cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"3"}}
  %v1 = f32[16]{0} get-tuple-element(%inner), index=1
  ROOT %ot = (s32[], bf16[16,32]{1,0}, f32[16]{0}) tuple(%k2, %rsd, %v1)
}

%outer_cond (oc: (s32[], bf16[16,32], f32[16])) -> pred[] {
  %oc = (s32[], bf16[16,32]{1,0}, f32[16]{0}) parameter(0)
  %kk = s32[] get-tuple-element(%oc), index=0
  %ten = s32[] constant(10)
  ROOT %gt = pred[] compare(%ten, %kk), direction=GT
}

%free_body (fp: (f32[], f32[])) -> (f32[], f32[]) {
  %fp = (f32[], f32[]) parameter(0)
  %a = f32[] get-tuple-element(%fp), index=0
  %b = f32[] get-tuple-element(%fp), index=1
  %s = f32[] all-reduce(%a), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %ft = (f32[], f32[]) tuple(%s, %b)
}

%free_cond (fc: (f32[], f32[])) -> pred[] {
  %fc = (f32[], f32[]) parameter(0)
  %c = f32[] get-tuple-element(%fc), index=0
  %d = f32[] get-tuple-element(%fc), index=1
  ROOT %less = pred[] compare(%c, %d), direction=LT
}

ENTRY %main (arg: bf16[16,32]) -> f32[] {
  %arg = bf16[16,32]{1,0} parameter(0)
  %c0 = s32[] constant(0)
  %start = s32[]{:T(128)} copy(%c0)
  %vec = f32[16]{0} constant({...})
  %buf = f32[128]{0} constant({...})
  %p1 = f32[4,8]{1,0} constant({...})
  %p2 = f32[4,8]{1,0} constant({...})
  %x0 = f32[] constant(0)
  %y0 = f32[] constant(1)
  %init = (s32[], bf16[16,32]{1,0}, f32[16]{0}) tuple(%start, %arg, %vec)
  %outer = (s32[], bf16[16,32]{1,0}, f32[16]{0}) while(%init), condition=%outer_cond, body=%outer_body, \
metadata={op_name="jit(step)/while"}
  %cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%buf), channel_id=5, \
source_target_pairs={{0,1},{1,0}}
  %cpd = f32[128]{0} collective-permute-done(%cps)
  %a2a = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-to-all(%p1, %p2), channel_id=7, replica_groups={}
  %fi = (f32[], f32[]) tuple(%x0, %y0)
  %free = (f32[], f32[]) while(%fi), condition=%free_cond, body=%free_body, \
metadata={op_name="jit(step)/while_loop"}
  ROOT %r = f32[] get-tuple-element(%free), index=0
}
"""


def test_hand_written_module():
    """Every kind counted by hand: runs = trip counts multiplied, async pairs once, bytes from shapes."""
    traffic = collective_traffic(MODULE)
    got = {k: (v.ops, v.executions, v.bytes, v.traffic_bytes) for k, v in traffic.kinds.items()}
    gathered = 32 * 32 * 2  # all-gather-done result, bf16[32,32], group of 4 ('fsdp'), 5 outer runs
    scattered = 16 * 32 * 2 * 4  # reduce-scatter operand = result bf16[16,32] × group of 4, 5 runs
    reduced = 16 * 4  # f32[16] in a group of 4 (iota), 5 × 3 runs; plus f32[] over 8, once (unknown loop)
    assert got == {
        "all-gather": (1, 5, 5 * gathered, 5 * gathered * 3 / 4),
        "reduce-scatter": (1, 5, 5 * scattered, 5 * scattered * 3 / 4),
        "all-reduce": (2, 15 + 1, 15 * reduced + 4, 15 * 2 * reduced * 3 / 4 + 2 * 4 * 7 / 8),
        "all-to-all": (1, 1, 2 * 4 * 8 * 4, 2 * 4 * 8 * 4 * 7 / 8),  # empty groups: all 8 partitions
        "collective-permute": (1, 1, 128 * 4, 128 * 4),
    }
    assert traffic.unknown_loops == ("free (jit(step)/while_loop)",)


def test_fsdp_scan_on_eight_cpu_devices():
    """XLA:CPU gathers each layer's float32 weight inside the loop (it prints the trip count)."""
    env = {**os.environ, "XLA_FLAGS": with_devices(8), "JAX_PLATFORMS": "cpu"}
    code = (
        "import sys, jax; sys.path.insert(0, sys.argv[1]); from test_aot_collectives import fsdp_hlo; "
        "print(fsdp_hlo(jax.devices(), 'float32'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert_gathered_per_layer(out.stdout, devices=8, itemsize=4)


@pytest.mark.parametrize("slice_name", ["v5e-8", "v5p-8"])
def test_fsdp_scan_on_tpu(slice_name):
    """The TPU compiler prints no trip count; the loop's counter gives it. bf16 weights, gathered as bf16."""
    devices = tpu_devices_of(slice_name)
    assert_gathered_per_layer(fsdp_hlo(devices, "bfloat16"), devices=len(devices), itemsize=2)


# The TPU compiler's overlapped all-gather (as it prints it for a weight gathered under an FSDP matmul):
# a start fusion, a continuation fusion and a done fusion, each calling a computation with a copy of the
# same all-gather (channel 6). Plus a ragged all-to-all sending 8 rows of a 64-row output buffer.
TPU_ASYNC_MODULE = """\
HloModule overlapped, num_partitions=4

%fused_start (p0: bf16[8,56]) -> (bf16[8,56], bf16[8,224]) {
  %p0 = bf16[8,56]{1,0} parameter(0)
  %ag0 = bf16[8,224]{1,0} all-gather(%p0), channel_id=6, replica_groups={{0,1,2,3}}, dimensions={1}
  ROOT %t0 = (bf16[8,56]{1,0}, bf16[8,224]{1,0}) tuple(%p0, %ag0)
}

%async_collective_fusion.1 (p1: bf16[8,56]) -> (bf16[8,56], bf16[8,224]) {
  %p1 = bf16[8,56]{1,0} parameter(0)
  %ag1 = bf16[8,224]{1,0} all-gather(%p1), channel_id=6, replica_groups={{0,1,2,3}}, dimensions={1}
  ROOT %t1 = (bf16[8,56]{1,0}, bf16[8,224]{1,0}) tuple(%p1, %ag1)
}

%fused_done (p2: bf16[8,56]) -> bf16[8,224] {
  %p2 = bf16[8,56]{1,0} parameter(0)
  ROOT %ag2 = bf16[8,224]{1,0} all-gather(%p2), channel_id=6, replica_groups={{0,1,2,3}}, dimensions={1}
}

ENTRY %main (w: bf16[8,56], rows: f32[8,16], out: f32[64,16], offs: s32[4]) -> bf16[8,224] {
  %w = bf16[8,56]{1,0} parameter(0)
  %rows = f32[8,16]{1,0} parameter(1)
  %out = f32[64,16]{1,0} parameter(2)
  %offs = s32[4]{0} parameter(3)
  %async-collective-start = (bf16[8,56]{1,0}, bf16[8,224]{1,0}) fusion(%w), kind=kCustom, calls=%fused_start
  %g = bf16[8,56]{1,0} get-tuple-element(%async-collective-start), index=0
  %fusion.1 = (bf16[8,56]{1,0}, bf16[8,224]{1,0}) fusion(%g), kind=kCustom, calls=%async_collective_fusion.1
  %g1 = bf16[8,56]{1,0} get-tuple-element(%fusion.1), index=0
  %async-collective-done = bf16[8,224]{1,0} fusion(%g1), kind=kCustom, calls=%fused_done
  %r = f32[64,16]{1,0} ragged-all-to-all(%rows, %out, %offs, %offs, %offs, %offs), channel_id=9, \
replica_groups={{0,1,2,3}}
  ROOT %done = bf16[8,224]{1,0} copy(%async-collective-done)
}
"""


def test_tpu_overlapped_collective_counts_once_and_ragged_all_to_all_counts_its_rows():
    traffic = collective_traffic(TPU_ASYNC_MODULE)
    gathered = traffic.kinds["all-gather"]
    assert (gathered.ops, gathered.executions, gathered.bytes) == (1, 1, 8 * 224 * 2)
    exchanged = traffic.kinds["all-to-all"]  # the 8 rows it may send, not the 64-row output buffer
    assert (exchanged.ops, exchanged.bytes, exchanged.traffic_bytes) == (1, 8 * 16 * 4, 8 * 16 * 4 * 3 / 4)


# The same ragged all-to-all as the TPU compiler of JAX 0.12 prints it: an asynchronous pair whose start
# holds (operands), the result and two contexts.
RAGGED_ASYNC_MODULE = """\
HloModule ragged, num_partitions=4

ENTRY %main (rows: f32[8,16], out: f32[64,16], offs: s32[4]) -> f32[64,16] {
  %rows = f32[8,16]{1,0} parameter(0)
  %out = f32[64,16]{1,0} parameter(1)
  %offs = s32[4]{0} parameter(2)
  %rs = ((f32[8,16]{1,0}, f32[64,16]{1,0}, s32[4]{0}, s32[4]{0}, s32[4]{0}, s32[4]{0}), f32[64,16]{1,0}, \
u32[], u32[]) ragged-all-to-all-start(%rows, %out, %offs, %offs, %offs, %offs), channel_id=9, \
replica_groups={{0,1,2,3}}
  ROOT %rd = f32[64,16]{1,0} ragged-all-to-all-done(%rs)
}
"""


def test_asynchronous_ragged_all_to_all_counts_its_rows_once():
    exchanged = collective_traffic(RAGGED_ASYNC_MODULE).kinds["all-to-all"]
    assert (exchanged.ops, exchanged.bytes, exchanged.traffic_bytes) == (1, 8 * 16 * 4, 8 * 16 * 4 * 3 / 4)


MULTISLICE = """HloModule jit_step, num_partitions=4

ENTRY %main (p: f32[8,128]) -> f32[8,128] {
  %p = f32[8,128]{1,0} parameter(0)
  %ar = f32[8,128]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, \
to_apply=%add
  %tok = token[] after-all()
  %send = (f32[8,128]{1,0}, u32[], token[]) send(%ar, %tok), channel_id=3, is_host_transfer=true, \
frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",\
_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[8,128]{1,0}, u32[], token[]) recv(%tok), channel_id=2, is_host_transfer=true, \
frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",\
_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %sd = token[] send-done(%send), channel_id=3, is_host_transfer=true
  %rd = (f32[8,128]{1,0}, token[]) recv-done(%recv), channel_id=2, is_host_transfer=true
  ROOT %r = f32[8,128]{1,0} get-tuple-element(%rd), index=0
}
""".replace("\\\n", "")


def test_a_transfer_between_slices_counts_as_dcn_traffic():
    """A multislice program is one slice's: the all-reduce across slices is a megascale send/recv pair,
    counted once (the send), with the ring traffic over its 2 slices, all of it over the DCN."""
    traffic = collective_traffic(MULTISLICE)
    reduce = traffic.kinds["all-reduce"]
    payload = 8 * 128 * 4
    ici = 2 * payload * 3 / 4  # the in-slice all-reduce over 4 devices
    dcn = 2 * payload * 1 / 2  # the same buffer over the 2 slices
    assert (reduce.ops, reduce.executions, reduce.bytes) == (2, 2, 2 * payload)
    assert reduce.traffic_bytes == ici + dcn and reduce.dcn_traffic_bytes == dcn == traffic.dcn_traffic_bytes
    assert [op.dcn for op in traffic.ops] == [False, True]


def test_a_kernel_config_spanning_lines_does_not_end_its_computation():
    """A Pallas kernel's backend config may hold a newline, so a line of the loop body can start with
    `}}`: the body goes on to its ROOT, and the loop's trip count is still read."""
    kernel = ('  %kernel = f32[16]{0} custom-call(%v1), custom_call_target="tpu_custom_call", '
              'backend_config={"custom_call_config": {"metadata":"{\\"block_q\\": 512,\n'
              '}}, metadata={op_name="pallas_call"}\n')
    root = "  ROOT %ot = (s32[], bf16[16,32]{1,0}, f32[16]{0}) tuple(%k2, %rsd, %v1)"
    assert MODULE.count(root) == 1
    spanning = MODULE.replace(root, kernel + root)
    assert collective_traffic(spanning).kinds == collective_traffic(MODULE).kinds
