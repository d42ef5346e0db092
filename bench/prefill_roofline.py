"""FlexPrefill's attention on a TPU chip, bounded from compiled executables: `long_prefill.py --topology`.

For one layer's real q, k (a prompt of N tokens) and a TPU generation, against dense splash attention on
the same shapes:

- the selection (`flexprefill.select_blocks`) compiled for the chip: its FLOPs are XLA's count (the
  program has no loop, so it is whole), its HBM bytes the compile report's walk of the optimised HLO
  (`upcycler.train.aot.hbm_traffic`; XLA's own "bytes accessed" charges each sort many times over and
  counts arrays kept on chip: 644 MB against 44 MB for a 4k prompt);
- the sparse kernel (`flexprefill_splash`, the selection's blocks) and the dense one (splash's causal
  attention in `DENSE_TILE` tiles), both compiled for the chip: XLA counts a Pallas kernel as
  `compiler_flops` (reported; the kernels declare no cost, so it stays near 0), so their work is
  counted here from the masks: every executed (head, query block, key block) step does 4·b²·h FLOPs
  (QKᵀ and PV, the diagonal's masked half included) and reads one key and one value block; each query
  block and output is read and written once;
- the roofline time of each, max(FLOPs / peak, bytes / HBM bandwidth), with the chip's published bf16
  peak and bandwidth, inputs in bf16 (what a TPU prefill would use); `ratio` = dense / (selection + sparse).

These are bounds, not measurements. A kernel step also pays a fixed cost, about 0.35 µs on TPU as the
Pallas TPU pipelining guide gives it, which a 128-token block (4 MFLOP at h = 64) does not hide:
`grid_steps` (the kernel's iterations, empty ones included) is reported, and `with_step_cost_s` adds
`STEP_COST_S` per step to each kernel's roofline time, an estimate rather than a bound.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from upcycler import hardware
from upcycler.train.aot.topology import parse_slice, tpu_devices
from upcycler.train.model import flexprefill_splash as fs
from upcycler.train.model.flexprefill import FlexPrefillOptions, select_blocks

BF16 = 2
STEP_COST_S = 0.35e-6  # a Pallas TPU grid step's fixed cost (JAX's Pallas TPU pipelining guide)


def _compile(fn, shapes, chip: str):
    """`fn` compiled for one chip of generation `chip`, and that chip's figures."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = tpu_devices(parse_slice(f"{chip}-{8 if chip in ('v4', 'v5p') else 4}"))
    mesh = Mesh(devices[:1], ("chip",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, PartitionSpec())) for s, d in shapes]
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled, hardware.for_devices(devices), time.perf_counter() - start


def _costs(compiled) -> dict:
    from upcycler.train.aot.hbm_traffic import hbm_bytes

    cost = compiled.cost_analysis() or {}
    memory = compiled.memory_analysis()
    return {"compiler_flops": float(cost.get("flops", 0.0)), "compiler_bytes": float(cost.get("bytes accessed", 0.0)),
            "hbm_bytes": hbm_bytes(compiled.as_text()), "temp_gib": round(memory.temp_size_in_bytes / 2**30, 3)}


def _kernel_work(steps: int, q_blocks: int, block: int, h: int) -> tuple[float, float]:
    """FLOPs and HBM bytes of a splash kernel executing `steps` (head, query block, key block) steps over
    `q_blocks` (head, query block) rows of `block` tokens and head size h, in bf16."""
    flops = 4.0 * block * block * h * steps
    bytes_ = 2.0 * block * h * BF16 * steps + 2.0 * block * h * BF16 * q_blocks  # k, v per step; q in, out
    return flops, bytes_


def _roofline(flops: float, bytes_: float, chip) -> float:
    return max(flops / chip.peak_bf16_flops, bytes_ / chip.hbm_bandwidth)


def layer_bound(q_NHh, k_NKh, opts: FlexPrefillOptions, chip_name: str, compiled: dict) -> dict:
    """The roofline comparison of one layer (module docstring); `compiled` caches executables by shape."""
    N, H, h = q_NHh.shape
    K = k_NKh.shape[1]
    nb = opts.blocks(N)
    with jax.default_matmul_precision("highest"):
        mask_Hnn = np.asarray(jax.jit(select_blocks, static_argnames="opts")(q_NHh, k_NKh, opts).mask_Hnn)
    causal = nb * (nb + 1) / 2
    density = float(mask_Hnn.sum() / (H * causal))
    fallback = bool(opts.runs_dense(N) or density > opts.dense_above)
    key = (N, H, K, h, chip_name)
    if key not in compiled:
        bf = jnp.bfloat16
        qkv = [((1, N, H, h), bf), ((1, N, K, h), bf), ((1, N, K, h), bf)]
        compiled[key] = {
            "select": _compile(lambda q, k: select_blocks(q, k, opts), [((N, H, h), bf), ((N, K, h), bf)], chip_name),
            "flexprefill": _compile(lambda q, k, v: fs.flexprefill_attention(q, k, v, opts), qkv, chip_name),
            "dense": _compile(lambda q, k, v: fs.dense_attention(q, k, v), qkv, chip_name),
        }
    programs = compiled[key]
    chip = programs["select"][1]

    T = fs.DENSE_TILE
    nt = math.ceil(N / T)
    dense_flops, dense_bytes = _kernel_work(int(H * nt * (nt + 1) / 2), H * nt, T, h)
    if fallback:  # one prompt: a fallback runs the dense kernel
        sparse_flops, sparse_bytes, sparse_grid = dense_flops, dense_bytes, H * nt * nt
    else:
        width = next(w for w in fs.step_widths(nb) if w >= int(mask_Hnn.sum(-1).max()))
        sparse_flops, sparse_bytes = _kernel_work(int(mask_Hnn.sum()), H * nb, opts.block, h)
        sparse_grid = H * nb * width
    select = _costs(programs["select"][0])
    select_s = _roofline(select["compiler_flops"], select["hbm_bytes"], chip)
    sparse_s, dense_s = _roofline(sparse_flops, sparse_bytes, chip), _roofline(dense_flops, dense_bytes, chip)
    return {
        "density": round(density, 4), "fallback": fallback,
        "flops": {"selection": select["compiler_flops"], "sparse_kernel": sparse_flops, "dense_kernel": dense_flops},
        "bytes": {"selection": select["hbm_bytes"], "sparse_kernel": sparse_bytes, "dense_kernel": dense_bytes,
                  "selection_by_xla": select["compiler_bytes"]},
        "compiler_flops": {"flexprefill": _costs(programs["flexprefill"][0])["compiler_flops"],
                           "dense": _costs(programs["dense"][0])["compiler_flops"]},
        "roofline_s": {"selection": select_s, "sparse_kernel": sparse_s, "flexprefill": select_s + sparse_s,
                       "dense": dense_s},
        "ratio": round(dense_s / (select_s + sparse_s), 3),
        "grid_steps": {"flexprefill": sparse_grid, "dense": H * nt * nt},
        "with_step_cost_s": {"flexprefill": select_s + sparse_s + STEP_COST_S * sparse_grid,
                             "dense": dense_s + STEP_COST_S * H * nt * nt},
        "temp_gib": {name: _costs(programs[name][0])["temp_gib"] for name in programs},
        "compile_s": {name: round(programs[name][2], 1) for name in programs},
    }
