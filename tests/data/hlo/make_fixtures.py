"""Regenerate the HLO fixtures of `tests/test_hlo_printers.py`: small programs compiled for a TPU v5e-4
slice (libtpu's topology, no chip needed), their optimised HLO as each JAX prints it, and XLA's own figures.

Run it once under each JAX whose printer the readers must follow, from the repository root:

    python tests/data/hlo/make_fixtures.py      # under JAX 0.10 (Python 3.11), then again under JAX 0.12

It writes, per program NAME and JAX version VER (`jax010`, `jax012`, …):

- `NAME.VER.hlo`: `compiled.as_text()`;
- `NAME.VER.compact.hlo` (JAX 0.11 and later): the same executable's module as the compiler prints it
  with compact tuple elements (`%while#1` for `get-tuple-element(%while), index=1`), the printer option
  XLA's debug option `xla_dump_compact_gte` turns on, read from the compiler's dump of the optimised module;
- `figures.json`, entry VER: XLA's `cost_analysis()` figures (`flops`, `bytes accessed`) of each program
  and the versions that compiled it, so the test compares against XLA without this JAX installed.

Only what the readers cannot use is cut from the texts: a Pallas kernel's serialised body and debug
locations (large, and they hold the compiling machine's file paths), and the directories of the source
files in the stack-frame tables (a library file keeps its path from `site-packages/` on, a file of this
repository its path inside it).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
JAX = tuple(int(n) for n in re.findall(r"\d+", version("jax"))[:2])
TAG = f"jax{JAX[0]}{JAX[1]:02d}"
COMPACT = JAX >= (0, 11)  # older libtpu does not know the option
DUMP = tempfile.mkdtemp(prefix="hlo-dump-")
if COMPACT:  # read once, when the backend starts: set before JAX is imported
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP} --xla_dump_hlo_as_text "
                               "--xla_dump_compact_gte=true").strip()
sys.path.insert(0, str(REPO))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from upcycler.train.aot.topology import parse_slice, tpu_devices

ROWS, WIDTH, LAYERS = 128, 256, 3
# the layer stack in bf16, large enough that its weights stay in HBM (a layer's two: 16 MiB) and the loop
# body reads its own layer's from there
STACK_ROWS, STACK_WIDTH = 512, 2048
KERNEL_BYTES = 123_456  # the Pallas kernel's own estimate, far above its 8 KiB of operand and result
SHARDS = 4


def layer(x, w):
    return x + jnp.tanh(x @ w[0]) @ w[1]


def layers_scan(x, ws):
    """The layers under `lax.scan`: a while loop whose trip count is LAYERS."""
    return jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]


def layers_unrolled(x, ws):
    """The same layers one after another: no loop."""
    for i in range(LAYERS):
        x = layer(x, ws[i])
    return x


def sort_pairs(keys, values):
    """A sort of two operands: its result is a tuple whose two elements are used."""
    k, v = jax.lax.sort((keys, values), num_keys=1)
    return k * 2 + v


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def kernel(x):
    """A Pallas TPU kernel with a cost estimate and kernel metadata (printed over three lines)."""
    call = pl.pallas_call(
        _double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        cost_estimate=pl.CostEstimate(flops=2 * x.size, transcendentals=0, bytes_accessed=KERNEL_BYTES),
        metadata={"xprof_metadata": json.dumps({"block_q": 512, "block_kv": 256})},
    )
    return call(x) + 1


def _shard_map(mesh):
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    return lambda f, **kw: shard_map(f, mesh=mesh, **kw)


def collectives(mesh):
    """Over SHARDS devices: gather a weight sharded by rows, multiply, reduce-scatter the product."""

    def body(x, w):
        whole = jax.lax.all_gather(w, "x", axis=0, tiled=True)
        return jax.lax.psum_scatter(x @ whole, "x", scatter_dimension=0, tiled=True)

    return _shard_map(mesh)(body, in_specs=(P("x"), P("x")), out_specs=P("x"))


def fsdp_scan(mesh):
    """FSDP over SHARDS devices: two weights per layer, each gathered whole inside the layer loop; the TPU
    compiler overlaps one's gather with the other's matmul (an `async-collective-start`, continuation
    fusions calling `async_collective_fusion` computations, an `async-collective-done`)."""

    def forward(ws, x):
        def step(h, w):
            for wk in w:
                wk = jax.lax.with_sharding_constraint(wk.astype(jnp.bfloat16), NamedSharding(mesh, P()))
                h = h + jnp.tanh(h @ wk)
            return h, None

        return jax.lax.scan(step, x, ws)[0]

    return forward


def programs(devices):
    one = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P())
    mesh = Mesh(np.asarray(devices[:SHARDS]), ("x",))
    f32 = jnp.float32

    def arg(shape, dtype, sharding=one):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    x, ws = arg((STACK_ROWS, STACK_WIDTH), jnp.bfloat16), arg((LAYERS, 2, STACK_WIDTH, STACK_WIDTH), jnp.bfloat16)
    rows = NamedSharding(mesh, P("x"))
    weight = arg((LAYERS, WIDTH, WIDTH), f32, NamedSharding(mesh, P(None, None, "x")))
    fsdp = ((weight, weight), arg((ROWS, WIDTH), jnp.bfloat16, rows))
    return {
        "layers_scan": (layers_scan, (x, ws)),
        "layers_unrolled": (layers_unrolled, (x, ws)),
        "sort_pairs": (sort_pairs, (arg((4096,), f32), arg((4096,), f32))),
        "kernel": (kernel, (arg((8, 128), f32),)),
        "collectives": (collectives(mesh), (arg((ROWS, WIDTH), f32, rows), arg((WIDTH, WIDTH), f32, rows))),
        "fsdp_scan": (fsdp_scan(mesh), fsdp),
    }


def tidy(text: str) -> str:
    """`text` without what the readers never read and what names this machine (see the module docstring)."""
    text = re.sub(r'"(body|debug_locations)":"[^"]*"', r'"\1":""', text)

    def short(m: re.Match) -> str:
        path = m.group(2)
        if "site-packages/" in path:
            path = "site-packages/" + path.split("site-packages/", 1)[1]
        elif path.startswith(str(REPO) + "/"):
            path = path[len(str(REPO)) + 1:]
        return f'{m.group(1)}"{path}"'

    head, sep, rest = text.partition("\nFunctionNames\n")  # the file names come first
    return re.sub(r'(?m)^(\d+ )"([^"]*)"', short, head) + sep + rest


def main() -> None:
    devices = tpu_devices(parse_slice("v5e-4"))
    figures = {}
    for name, (fn, args) in programs(devices).items():
        fn.__name__ = f"fixture_{name}"  # the module's name, `jit_fixture_NAME`, finds its dump
        compiled = jax.jit(fn).lower(*args).compile()
        (HERE / f"{name}.{TAG}.hlo").write_text(tidy(compiled.as_text()))
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        figures[name] = {key: float(cost[key]) for key in ("flops", "bytes accessed")}
        if COMPACT:
            dumped = glob.glob(f"{DUMP}/*.jit_fixture_{name}.*after_optimizations.txt")
            assert len(dumped) == 1, dumped
            (HERE / f"{name}.{TAG}.compact.hlo").write_text(tidy(Path(dumped[0]).read_text()))
        print(name, figures[name])
    path = HERE / "figures.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    table[TAG] = {"jax": version("jax"), "jaxlib": version("jaxlib"), "libtpu": version("libtpu"),
                  "programs": figures}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
