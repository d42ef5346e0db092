"""The megablox grouped-matmul backend: results, backend choice for the target platform, TPU compiles.

On a host without a TPU the Pallas kernel runs in interpret mode, so its results are checked against the
tiled backend at tiny sizes. The TPU checks compile for a v5e-4 slice described by libtpu (no chip
needed) and read the compiled HLO; they are skipped when libtpu is not installed.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_checks import TPU_AUTO, assert_transposed_weight_gives_the_same, gmm_with_grads
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from upcycler.train.aot.compile import without_persistent_cache
from upcycler.train.model import moe
from upcycler.train.model.gmm import gmm, resolve_backend
from upcycler.train.model.gmm_megablox import megablox_gmm
from upcycler.train.model.gmm_tiles import Tiles, gmm_tiles, phase_tiles, tgmm_tiles

F32_TOL = {"rtol": 2e-5, "atol": 2e-5}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}

# name: (rows M, in, out, group sizes, dtype); all but the "full_rows" case leave rows past the groups
GMM_CASES = {
    "aligned_with_empty_groups": (256, 128, 256, [60, 0, 100, 0, 40], jnp.float32),
    "unaligned_dims_and_rows": (200, 100, 72, [30, 0, 0, 101, 45], jnp.float32),
    "full_rows_group_crossing_tiles": (256, 128, 128, [0, 130, 126], jnp.float32),
    "bfloat16": (128, 128, 128, [0, 77, 40], jnp.bfloat16),
}


def _case_arrays(m, k, n, sizes, dtype, seed=0):
    """x, w, cotangent with entries of order 1 in the products; the cotangent is nonzero on every row."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), dtype)
    cotangent = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32), cotangent


@pytest.mark.parametrize("name", GMM_CASES)
def test_megablox_matches_tiled_in_output_and_gradients(name: str) -> None:
    m, k, n, sizes, dtype = GMM_CASES[name]
    args = _case_arrays(m, k, n, sizes, dtype)
    out, (dx, dw) = gmm_with_grads("megablox")(*args)
    want_out, (want_dx, want_dw) = gmm_with_grads("tiled")(*args)
    tol = BF16_TOL if dtype == jnp.bfloat16 else F32_TOL
    assert out.dtype == dx.dtype == dw.dtype == dtype
    assert out.shape == (m, n) and dx.shape == (m, k) and dw.shape == (len(sizes), k, n)
    for got, want, what in ((out, want_out, "out"), (dx, want_dx, "dx"), (dw, want_dw, "dw")):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got)), what
        np.testing.assert_allclose(got, want, err_msg=what, **tol)
    # rows no group owns: output exactly zero, no gradient reaches x from them
    np.testing.assert_array_equal(np.asarray(out[sum(sizes) :], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(dx[sum(sizes) :], np.float32), 0.0)


@pytest.mark.parametrize("backend", ["megablox", "tiled", "ragged_dot"])
def test_a_weight_read_transposed_gives_the_same_product_and_gradients(backend: str) -> None:
    """`transpose_rhs` (the MoE's down weight as stored, [G, out, in]): megablox reads it transposed in its
    kernels (dW from tgmm of dyᵀ and x, padding on the swapped widths); the others swap it first."""
    m, k, n, sizes, dtype = GMM_CASES["unaligned_dims_and_rows"]
    assert_transposed_weight_gives_the_same(backend, *_case_arrays(m, k, n, sizes, dtype), **F32_TOL)


def test_every_row_grouped_needs_no_masks_and_gives_the_same() -> None:
    # the dropless layer's promise (sum of the groups == rows): the masks are left out, nothing changes;
    # rows unaligned to the kernel's tiles, so the padding is there and must still be dropped
    x, w, sizes, cotangent = _case_arrays(200, 100, 72, [0, 130, 70], jnp.float32, seed=1)

    def run(all_rows_grouped):
        return jax.jit(lambda x, w: jax.vjp(
            lambda x, w: megablox_gmm(x, w, sizes, interpret=True, all_rows_grouped=all_rows_grouped), x, w))(x, w)

    (out, vjp), (want_out, want_vjp) = run(True), run(False)
    np.testing.assert_array_equal(out, want_out)
    for got, want in zip(vjp(cotangent), want_vjp(cotangent)):
        np.testing.assert_array_equal(got, want)


def test_tiles_fit_the_vmem_and_weigh_bytes_against_wasted_flops() -> None:
    # the reference MoE's gate/up product per v5e chip: 131072 rows, 64 experts, 1792 -> 2304, bf16
    m, k, n, g = 131072, 1792, 2304, 64
    forward = gmm_tiles(m, k, n, g, in_bytes=2, out_bytes=2, vmem=16 << 20)

    def charged(t: Tiles) -> int:  # megablox's estimate: the rows once per column tile, a weight per row tile
        return m * k * 2 * (n // t.tn) + k * n * 2 * (m // t.tm + g - 1) + m * n * 2

    def grid_flops(t: Tiles) -> int:  # megablox's grid: m / tm + g − 1 row steps, each a whole tile
        return 2 * (m // t.tm + g - 1) * t.tm * k * n

    def seconds(t: Tiles) -> float:  # on v5e: 197 TFLOP/s, 819 GB/s
        return max(charged(t) / 819e9, grid_flops(t) / 197e12)

    assert charged(forward) < 0.7 * charged(Tiles(512, 256, 256))  # the first tiles, at their row height
    # the scoped VMEM the compiler reports for such a kernel (double-buffered inputs, fp32 accumulator)
    assert 2 * (forward.tm * forward.tk + forward.tk * forward.tn) * 2 + 2 * forward.tm * forward.tn * 4 <= 16 << 20
    # with v5e's 64 MiB the least traffic comes from 2048-row tiles, whose grid multiplies 1.97× the product
    # (31 of 64 boundaries per 64 tiles): shorter rows win on time, for a little more traffic
    wide = gmm_tiles(m, k, n, g, in_bytes=2, out_bytes=2, vmem=64 << 20)
    tall = Tiles(2048, 256, 2304)
    assert grid_flops(tall) > 1.9 * 2 * m * k * n and charged(tall) < charged(wide)
    assert wide.tm <= 512 and grid_flops(wide) <= 1.25 * 2 * m * k * n
    assert seconds(wide) < 0.7 * seconds(tall) and seconds(wide) <= seconds(forward)
    # a chip with far more FLOPs per byte (compute cheap, bytes dear) takes the tall tiles back
    assert gmm_tiles(m, k, n, g, in_bytes=2, out_bytes=2, vmem=64 << 20, flops_per_byte=1e6).tm >= 2048
    for tiles in (*phase_tiles(m, k, n, g, in_bytes=2, out_bytes=2), tgmm_tiles(256, 128, 384, 4, in_bytes=4, out_bytes=4)):
        assert all(size % 128 == 0 for size in tiles)
    assert tgmm_tiles(256, 128, 384, 4, in_bytes=4, out_bytes=4) == Tiles(256, 128, 384)  # all of it fits
    with pytest.raises(ValueError, match="multiples of 128"):
        gmm_tiles(200, 128, 128, 2, in_bytes=4, out_bytes=4)


def test_megablox_dtypes() -> None:
    x, w = jnp.zeros((8, 4), jnp.float16), jnp.zeros((2, 4, 4), jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        megablox_gmm(x, w, jnp.array([4, 4], jnp.int32), interpret=True)


def test_auto_backend_follows_the_host_without_a_mesh() -> None:
    host = jax.default_backend()
    assert resolve_backend("auto") == {"cpu": "tiled", "tpu": TPU_AUTO, "gpu": "tiled"}.get(host, "ragged_dot")
    assert [resolve_backend("auto", p) for p in ("cpu", "tpu", "gpu", "rocm")] == ["tiled", TPU_AUTO, "tiled", "ragged_dot"]
    with jax.set_mesh(Mesh(np.array(jax.devices()[:1]), ("data",))):
        assert resolve_backend("auto") == resolve_backend("auto", host)
        assert resolve_backend("ragged_dot") == "ragged_dot"


# ---------------------------------------------------------------------------------- compiled for a TPU


@functools.cache
def _v5e_devices() -> list:
    pytest.importorskip("libtpu", reason="TPU compiles need libtpu (the [tpu] extra)")
    from upcycler.train.aot.topology import parse_slice, tpu_devices

    return tpu_devices(parse_slice("v5e-4"))


def _mesh(count: int) -> Mesh:
    return Mesh(np.array(_v5e_devices()[:count]), ("data",))


def _backend_traced_in_shard_map(mesh: Mesh) -> str:
    """What "auto" resolves to while tracing the body of a shard_map over every axis of `mesh`."""
    seen = []

    def body(x):
        seen.append(resolve_backend("auto"))
        return x

    spec = P("data")
    jax.eval_shape(
        jax.shard_map(body, in_specs=spec, out_specs=spec), jax.ShapeDtypeStruct((8,), jnp.float32)
    )
    return seen[0]


def test_auto_backend_follows_the_target_tpu_mesh() -> None:
    with jax.set_mesh(_mesh(1)):
        assert resolve_backend("auto") == TPU_AUTO
        assert resolve_backend("tiled") == "tiled"
    with jax.set_mesh(_mesh(4)):
        # a Pallas kernel cannot be partitioned by XLA: megablox only where each device runs it whole
        assert resolve_backend("auto") == "ragged_dot"
        assert _backend_traced_in_shard_map(_mesh(4)) == TPU_AUTO
        x, w = jax.ShapeDtypeStruct((128, 128), jnp.float32), jax.ShapeDtypeStruct((2, 128, 128), jnp.float32)
        group_sizes = jax.ShapeDtypeStruct((2,), jnp.int32)
        with pytest.raises(ValueError, match="shard_map"):
            jax.jit(functools.partial(gmm, backend="megablox")).lower(x, w, group_sizes)


T, D, F, E, TOP_K = 64, 128, 128, 4, 2  # X = T·k = 128 rows; widths multiples of 128


def _moe_loss(params, cotangent_TD, backend: str):
    x_TD, w_gate_up_EDU, w_down_EDF, w_router_ED = params
    routing = moe.route(moe.router_logits(x_TD, w_router_ED), TOP_K, "renormalized")
    y_TD = moe.dropless_moe(x_TD, w_gate_up_EDU, w_down_EDF, routing, backend=backend)
    return jnp.sum(y_TD.astype(jnp.float32) * cotangent_TD)


@functools.cache
def _compiled_moe_hlo(backend: str, devices: int) -> str:
    """HLO text of the MoE layer's loss and gradients (x, experts, router), compiled for v5e devices.

    Tokens are split over the mesh's devices, weights replicated; activations and weights are bf16.
    """
    mesh = _mesh(devices)

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    bf16, f32 = jnp.bfloat16, jnp.float32
    params = (
        arg((T, D), bf16, P("data")),
        arg((E, D, 2 * F), bf16, P()),
        arg((E, D, F), bf16, P()),
        arg((E, D), f32, P()),
    )
    step = jax.jit(jax.value_and_grad(functools.partial(_moe_loss, backend=backend)))
    with jax.set_mesh(mesh), without_persistent_cache():  # a v5e executable cannot be loaded back here
        return step.lower(params, arg((T, D), f32, P("data"))).compile().as_text()


def _tpu_kernels(hlo: str) -> list[str]:
    """The op name of every TPU custom call. Pallas kernels end in `pallas_call`; XLA lowers
    `lax.ragged_dot` to TPU custom calls of its own too (named `ragged-dot-...`)."""
    lines = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    return [line.split('op_name="', 1)[1].split('"', 1)[0] for line in lines if 'op_name="' in line]


@pytest.mark.parametrize(
    "backend,devices,pallas",
    [("megablox", 1, True), ("auto", 1, True), ("ragged_dot", 1, False), ("auto", 4, False)],
)
def test_moe_layer_compiles_for_v5e(backend: str, devices: int, pallas: bool) -> None:
    kernels = _tpu_kernels(_compiled_moe_hlo(backend, devices))
    megablox = [name for name in kernels if name.endswith("pallas_call")]
    if pallas:
        # two grouped matmuls (gate-up, down), each as forward, dx and dW kernels
        assert len(megablox) == 6, kernels
        assert sum("tgmm" in name for name in megablox) == 2, kernels
    else:
        assert megablox == [], kernels


def test_the_dropless_layer_on_v5e_has_no_row_masks() -> None:
    """Every row of the dropless buffer belongs to a group: the compiled layer carries no pass that zeroes
    rows past the groups (forward, cotangent) and no gather with a fill, read off the charged sources."""
    from upcycler.train.aot.hbm_traffic import breakdown

    sources = [row.name for row in breakdown(_compiled_moe_hlo("megablox", 1))]
    assert any(name.startswith("kernel tgmm") for name in sources), sources
    assert not any("gmm_rows.py" in name for name in sources), sources
    hlo = _compiled_moe_hlo("megablox", 1)
    fills = re.findall(r"= (?:bf16|f32)\[\d+,\d+\][^ ]* select\([^\n]*jit\(_take\)", hlo)
    assert "gather" in hlo and not fills, fills


@functools.cache
def _fsdp_gathers(split: bool) -> tuple[list[str], list[str]]:
    """(all-gathers of the expert weights, copies of a whole expert weight) in the MoE layer's loss and
    gradients compiled for 8 v5e chips of FSDP, 4 experts: with `split` on a mesh of fsdp_outer 4 × fsdp 2
    (`sharding.make_mesh(experts=4)`), else on one fsdp axis of 8 (the model width split 8 ways)."""
    from upcycler.train.aot.topology import parse_slice, tpu_devices
    from upcycler.train.config import ModelConfig
    from upcycler.train.loop import sharding
    from upcycler.train.model import expert_parallel

    devices = tpu_devices(parse_slice("v5e-8"))
    mesh = sharding.make_mesh(fsdp=8, devices=devices, experts=4 if split else 0)
    assert ("fsdp_outer" in mesh.shape) == split
    cfg = ModelConfig(compute_dtype="bfloat16", gmm_backend="megablox")
    tokens, width, hidden = 512, 256, 512

    def arg(shape, dtype, axes):
        spec = sharding.logical_to_spec(axes, shape, mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    def loss(x_TD, w_gate_up, w_down, w_router):
        routing = moe.route(moe.router_logits(x_TD, w_router), TOP_K, "renormalized")
        y_TD = expert_parallel.moe_layer(x_TD, w_gate_up, w_down, routing, cfg, sharding.PLACEMENT)
        return jnp.sum(y_TD.astype(jnp.float32) ** 2)

    args = (arg((tokens, width), jnp.bfloat16, expert_parallel.TOKEN_AXES),
            arg((4, width, 2 * hidden), jnp.bfloat16, expert_parallel.WEIGHT_AXES[0]),
            arg((4, width, hidden), jnp.bfloat16, expert_parallel.WEIGHT_AXES[1]),
            arg((4, width), jnp.float32, (None, None)))
    with jax.set_mesh(mesh), without_persistent_cache():
        hlo = jax.jit(jax.grad(loss, argnums=(1, 2))).lower(*args).compile().as_text()
    wholes = (f"bf16[4,{width},{2 * hidden}]", f"bf16[4,{width},{hidden}]")
    gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)]
    copies = [line for line in hlo.splitlines() if re.search(r"= (\S+) copy(-start)?\(", line)
              and any(line.split("= ", 1)[1].startswith(whole) for whole in wholes)]
    return gathers, copies


def test_the_expert_weights_gather_into_the_kernels_layout_on_a_split_fsdp() -> None:
    """The expert weights reach the kernels as gathered: the gate/up weight [E, D, 2F] and the down weight
    as stored ([E, D, F], which the kernel reads transposed) are gathered along the model width, which is
    not the minor dimension, so no whole expert weight is copied after its gather on one fsdp axis or on
    the fsdp_outer split (a down weight swapped to [E, F, D] before its gather was gathered along its
    minor dimension and relaid). Split, each is one all-gather of its E·D flattened rows over both axes."""
    flat_gathers, flat_copies = _fsdp_gathers(split=False)
    gathers, copies = _fsdp_gathers(split=True)
    assert flat_copies == copies == [], (flat_copies, copies)
    assert any(re.search(r"= bf16\[4,256,512\]", line) for line in flat_gathers), flat_gathers  # down, [E, D, F]
    for width in (1024, 512):  # E·D = 4·256 rows of gate/up (2F = 1024) and of down (F = 512)
        rows = [line for line in gathers if re.search(rf"= bf16\[(1,)?1024,{width}\]", line)]
        assert rows and all("replica_groups={{0,1,2,3,4,5,6,7}}" in line for line in rows), (width, gathers)


@pytest.mark.parametrize("chip,vmem_mib", [("v5e", 64), ("v6e", 64), ("v4", 16)])
def test_the_tiles_chosen_for_the_reference_moe_compile_within_the_chips_vmem(chip: str, vmem_mib: int) -> None:
    """The reference MoE's gate/up product per chip (131072 rows of 1792 against 64 experts' [1792, 2304]
    in bf16), forward and both gradients, compiled for one chip: every kernel's tiles fit the scoped VMEM
    the product gives it (64 MiB on v5e and v6e; v4's cores hold only 16 MiB, so its tiles keep to that
    under the same setting; a tile that does not fit fails the compile), together the three kernels'
    own estimates are under half of what the tiles used before moved (23.8 GB), and their grids, read
    from the compiled program, multiply at most a quarter more than the three products on v5e and v4
    (2048-row tiles, chosen by bytes alone, multiplied 1.7× to 1.97×), and at most 40% more on v6e, whose
    560 FLOP per byte of HBM make bytes dearer than FLOPs: taller tiles win there."""
    pytest.importorskip("libtpu", reason="TPU compiles need libtpu (the [tpu] extra)")
    from upcycler.train.aot.hbm_traffic import charges, matmul_flops
    from upcycler.train.aot.topology import parse_slice, tpu_devices
    from upcycler.train.model.gmm_megablox import scoped_vmem

    mesh = Mesh(np.array(tpu_devices(parse_slice(f"{chip}-8"))[:1]), ("chip",))
    on_chip = NamedSharding(mesh, P())
    m, k, n, g = 131072, 1792, 2304, 64
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip) for shape, dtype in
            (((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16), ((g,), jnp.int32), ((m, n), jnp.bfloat16))]

    def step(x, w, sizes, cotangent):
        out, vjp = jax.vjp(lambda x, w: megablox_gmm(x, w, sizes, interpret=False, all_rows_grouped=True), x, w)
        return out, vjp(cotangent)

    with jax.set_mesh(mesh), without_persistent_cache():
        assert scoped_vmem() == vmem_mib << 20
        hlo = jax.jit(step).lower(*args).compile().as_text()
    kernels = [c for c in charges(hlo) if c.is_kernel]
    assert len(kernels) == 3
    assert sum(c.estimate for c in kernels) < 0.5 * (7_465_992_192 + 7_331_774_464 + 8_984_199_168)
    assert 3 * 2 * m * k * n < matmul_flops(hlo) <= (1.4 if chip == "v6e" else 1.25) * 3 * 2 * m * k * n


def test_libtpu_is_given_the_kernels_vmem_unless_the_user_chose(monkeypatch) -> None:
    """`libtpu_defaults` raises the scoped VMEM for the chips that take it (on a host without chips: for the
    compiles), keeps a limit the user set, leaves v4 and unknown accelerators to libtpu; the tiles read
    the limit back, capped at a core's whole VMEM, and ignore it off TPU."""
    from upcycler.hardware import chip_for
    from upcycler.train.aot import topology
    from upcycler.train.model.gmm_megablox import scoped_vmem_of

    def given(env: dict[str, str], attached: bool) -> str | None:
        for key in ("LIBTPU_INIT_ARGS", "TPU_ACCELERATOR_TYPE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(topology.glob, "glob", lambda pattern: ["/dev/accel0"] if attached else [])
        topology.libtpu_defaults()
        return os.environ.get("LIBTPU_INIT_ARGS")

    flag = "--xla_tpu_scoped_vmem_limit_kib"
    assert given({}, attached=False) == f"{flag}=65536"
    assert given({"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=true"}, attached=False) == \
        f"--xla_enable_async_all_gather=true {flag}=65536"
    assert given({"LIBTPU_INIT_ARGS": f"{flag}=16384"}, attached=False) == f"{flag}=16384"
    assert given({"TPU_ACCELERATOR_TYPE": "v6e-256"}, attached=True) == f"{flag}=65536"
    assert given({"TPU_ACCELERATOR_TYPE": "v5litepod-16"}, attached=True) == f"{flag}=65536"
    assert given({"TPU_ACCELERATOR_TYPE": "v4-32"}, attached=True) is None
    assert given({"TPU_ACCELERATOR_TYPE": "v9x-8"}, attached=True) is None

    monkeypatch.setenv("LIBTPU_INIT_ARGS", f"{flag}=65536")
    assert scoped_vmem_of(chip_for("TPU v5 lite")) == 64 << 20
    assert scoped_vmem_of(chip_for("TPU v4")) == 16 << 20
    assert scoped_vmem_of(chip_for("cpu")) == scoped_vmem_of(None) == 16 << 20
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    assert scoped_vmem_of(chip_for("TPU v6 lite")) == 32 << 20  # libtpu's own default
