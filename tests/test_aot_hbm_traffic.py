"""HBM traffic from the optimised HLO with loops counted (`upcycler.train.aot.hbm_traffic`).

Two anchors from XLA itself, on this host's CPU compiler: a program without loops is charged what XLA's
cost analysis charges it (within the slices XLA charges whole), and the same layers run under `lax.scan`
are charged like the unrolled program, growing with the depth where XLA's figure stays flat. Hand-written
HLO pins the rules for in-place updates, slices and on-chip arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from upcycler.train.aot.compile_report import _bytes_accessed
from upcycler.train.aot.hbm_traffic import hbm_array_bytes, hbm_bytes

X = jax.ShapeDtypeStruct((256, 512), jnp.float32)


def _layer(x, w):
    return x + jnp.tanh(x @ w[0]) @ w[1]


def _scanned(x, ws):
    return jax.lax.scan(lambda c, w: (_layer(c, w), None), x, ws)[0]


def _unrolled(x, ws):
    for i in range(ws.shape[0]):
        x = _layer(x, ws[i])
    return x


def _compiled(fn, depth):
    return jax.jit(fn).lower(X, jax.ShapeDtypeStruct((depth, 2, 512, 512), jnp.float32)).compile()


@pytest.fixture(scope="module")
def programs():
    return {(fn.__name__, depth): _compiled(fn, depth) for fn in (_scanned, _unrolled) for depth in (2, 8)}


def test_a_program_without_loops_is_charged_what_xla_charges(programs):
    for depth in (2, 8):
        compiled = programs[("_unrolled", depth)]
        # XLA charges a fusion that slices one layer out of the stacked weights the whole stack's slice
        # before the inner slice; we charge the inner slice: at most that much less, never more
        assert 0.85 * _bytes_accessed(compiled) <= hbm_bytes(compiled.as_text()) <= _bytes_accessed(compiled)


def test_scanned_layers_are_charged_by_their_trip_count(programs):
    scanned = {d: hbm_bytes(programs[("_scanned", d)].as_text()) for d in (2, 8)}
    unrolled = {d: hbm_bytes(programs[("_unrolled", d)].as_text()) for d in (2, 8)}
    for depth in (2, 8):
        assert scanned[depth] == pytest.approx(unrolled[depth], rel=0.1)
    per_layer = (unrolled[8] - unrolled[2]) / 6
    assert (scanned[8] - scanned[2]) / 6 == pytest.approx(per_layer, rel=0.05)
    # what this module is for: XLA's own figure charges the loop body once, whatever the depth
    assert _bytes_accessed(programs[("_scanned", 8)]) == _bytes_accessed(programs[("_scanned", 2)])
    assert _bytes_accessed(programs[("_scanned", 8)]) < scanned[8] / 4


HLO = """HloModule m, entry_computation_layout={()->f32[8,1024]{1,0}}

%fused_update (p0: f32[8,1024], p1: f32[1,1024], p2: s32[]) -> f32[8,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[8,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %zero)
}

%fused_row (q0: f32[8,1024], q1: s32[]) -> f32[1,1024] {
  %q0 = f32[8,1024]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %ds = f32[1,1024]{1,0} dynamic-slice(%q0, %q1, %zero.1), dynamic_slice_sizes={1,1024}
  ROOT %neg = f32[1,1024]{1,0} negate(%ds)
}

%body (state: (s32[], f32[8,1024], f32[8,1024])) -> (s32[], f32[8,1024], f32[8,1024]) {
  %state = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %src = f32[8,1024]{1,0} get-tuple-element(%state), index=1
  %dst = f32[8,1024]{1,0} get-tuple-element(%state), index=2
  %row = f32[1,1024]{1,0:S(1)} fusion(%src, %i), kind=kLoop, calls=%fused_row
  %out = f32[8,1024]{1,0} fusion(%dst, %row, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) tuple(%next, %src, %out)
}

%cond (c: (s32[], f32[8,1024], f32[8,1024])) -> pred[] {
  %c = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) parameter(0)
  %n = s32[] get-tuple-element(%c), index=0
  %eight = s32[] constant(8)
  ROOT %lt = pred[] compare(%n, %eight), direction=LT
}

ENTRY %main () -> f32[8,1024] {
  %start = s32[] constant(0)
  %a = f32[8,1024]{1,0} constant({...})
  %b = f32[8,1024]{1,0} constant({...})
  %init = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) tuple(%start, %a, %b)
  %loop = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %res = f32[8,1024]{1,0} get-tuple-element(%loop), index=2
}
"""


def test_slices_in_place_updates_and_on_chip_arrays():
    """Eight iterations each read one row of `src` (4 KiB, written to on-chip memory: not charged) and
    write it into one row of `dst` in place (the row read from chip: 0; the row written: 4 KiB); the
    rest is scalars: the counter's add (two 4-byte reads, one write) 8 times, the condition's compare (two
    reads, a 1-byte write) 9 times, and each fusion's read of the counter."""
    row = 4 * 1024
    scalars = 8 * 12 + 9 * 9 + 8 * 2 * 4
    assert hbm_bytes(HLO) == 8 * (row + row) + scalars
    assert hbm_array_bytes("(f32[4]{0:S(1)}, f32[2]{0}, bf16[8]{0:T(8)S(0)})") == 8 + 16


def test_a_pallas_kernel_is_charged_its_own_cost_estimate():
    """A megablox grouped matmul compiled for v5e with tiles (512, 256, 256): 4096 rows of 512 against 8
    groups of [512, 1024] bf16 weights. Its operands and result are 21 MB, but with 4 column tiles the
    rows are read 4 times and, over 4096/512 + 8 - 1 = 15 row tiles, one group's 1 MiB weight once per
    tile: 4·4 MiB + 15·1 MiB + 8 MiB out. That is what the kernel's estimate in the HLO says and what the
    walker charges it, and the breakdown names the kernel. Its estimate's FLOPs count each row once, but
    the grid's 15 steps each multiply a whole 512-row tile (8 row tiles, 7 group boundaries inside them):
    its matmul FLOPs are 15/8 of 2·4096·512·1024, and 7/8 of that product is the waste."""
    pytest.importorskip("libtpu", reason="TPU compiles need libtpu (the [tpu] extra)")
    import importlib
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from upcycler.train.aot.compile import without_persistent_cache
    from upcycler.train.aot.hbm_traffic import breakdown, charges, grouped_matmul_waste, matmul_flops
    from upcycler.train.aot.topology import parse_slice, tpu_devices

    kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    mesh = Mesh([tpu_devices(parse_slice("v5e-4"))[0]], ("chip",))
    on_chip = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)
            for shape, dtype in (((4096, 512), jnp.bfloat16), ((8, 512, 1024), jnp.bfloat16), ((8,), jnp.int32))]
    step = jax.jit(lambda x, w, sizes: kernels.gmm(x, w, sizes, jnp.bfloat16, (512, 256, 256)))
    with jax.set_mesh(mesh), without_persistent_cache():  # a v5e executable cannot be loaded back here
        hlo = step.lower(*args).compile().as_text()
    mib = 1 << 20
    estimate = 4 * 4 * mib + 15 * mib + 8 * mib
    assert re.findall(r'"bytes_accessed":"(\d+)"', hlo) == [str(estimate)]  # XLA's dump carries the same figure
    (kernel,) = [c for c in charges(hlo) if c.is_kernel]
    assert kernel.bytes == kernel.estimate == estimate
    assert kernel.operand_bytes == pytest.approx(4 * mib + 8 * mib + 8 * mib, abs=4096)  # + the group tables
    top = breakdown(hlo)[0]
    assert top.name.startswith("kernel gmm") and top.bytes == estimate
    assert top.kernel_estimate == estimate - kernel.operand_bytes
    product = 2 * 4096 * 512 * 1024
    assert re.findall(r'"flops":"(\d+)"', hlo) == [str(product)]  # the estimate: each row once
    assert matmul_flops(hlo) == product * 15 / 8
    assert grouped_matmul_waste(hlo) == product * 7 / 8


NESTED = """HloModule n, entry_computation_layout={()->f32[1,1024]{1,0}}

%inner (r0: f32[8,1024], r1: s32[]) -> f32[1,1024] {
  %r0 = f32[8,1024]{1,0} parameter(0)
  %r1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%r0, %r1, %zero), dynamic_slice_sizes={1,1024}
}

%outer (p0: f32[8,1024], p1: s32[]) -> f32[1,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %row = f32[1,1024]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%inner
  ROOT %neg = f32[1,1024]{1,0} negate(%row)
}

ENTRY %main () -> f32[1,1024] {
  %stack = f32[8,1024]{1,0} constant({...})
  %i = s32[] constant(3)
  ROOT %out = f32[1,1024]{1,0} fusion(%stack, %i), kind=kLoop, calls=%outer
}
"""


def test_a_slice_taken_by_a_nested_fusion_is_charged_as_a_slice():
    """The TPU compiler nests fusions: a scanned layer's weight-gradient fusion reads its layer of the
    stacked activations through an inner fusion that slices them. Charged: the 4 KiB row read (and the
    scalar index), the 4 KiB row written; not the 32 KiB stack."""
    assert hbm_bytes(NESTED) == 4096 + 4 + 4096


ASYNC_SLICE = """HloModule a, entry_computation_layout={()->f32[1,1024]{1,0}}

%negate_row (p: f32[1,1024]) -> f32[1,1024] {
  %p = f32[1,1024]{1,0:S(1)} parameter(0)
  ROOT %n = f32[1,1024]{1,0} negate(%p)
}

ENTRY %main () -> f32[1,1024] {
  %stack = f32[8,1024]{1,0} constant({...})
  %start = ((f32[8,1024]{1,0}), f32[1,1024]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%stack), slice={[3:4], [0:1024]}
  %row = f32[1,1024]{1,0:S(1)} slice-done(%start)
  ROOT %out = f32[1,1024]{1,0} fusion(%row), kind=kLoop, calls=%negate_row
}
"""


def test_an_asynchronous_slice_is_charged_its_slice():
    """`Compiled.as_text()` prints an asynchronous slice in short form, its shape holding the whole operand
    beside the slice. Charged: the 4 KiB row read into on-chip memory, then written back by the fusion
    (4 KiB); not the 32 KiB operand, twice."""
    assert hbm_bytes(ASYNC_SLICE) == 4096 + 4096


def test_a_conditional_is_charged_one_branch_not_all():
    """A switch among 8 branches that move the same bytes (as splash's kernels per chunk place do) is
    charged what one branch moves, within the index's few bytes: one of them runs."""
    x = jnp.ones((1024, 1024), jnp.float32)
    branches = [lambda a, k=k: jnp.sin(a) * (k + 1) for k in range(8)]

    def switched(a, i):
        return jax.lax.switch(i, branches, a)

    one = jax.jit(branches[3]).lower(x).compile().as_text()
    chosen = jax.jit(switched).lower(x, jnp.int32(3)).compile().as_text()
    assert "conditional" in chosen
    assert hbm_bytes(chosen) == pytest.approx(hbm_bytes(one), rel=0.02)
