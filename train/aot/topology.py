"""TPU pod slices by name (`v5e-256`, `v5p-128`, `v6e-256`, or libtpu's own `v5e:16x16`), as devices to
compile for on a host without TPUs.

libtpu (the optional `[tpu]` extra) describes a slice's devices without any chip attached
(`jax.experimental.topologies.get_topology_desc`); `jax.jit(...).lower(...).compile()` then compiles for
them on this host. Slice names follow Cloud TPU: the number after the dash counts chips for v5e and v6e
and TensorCores (two per chip) for v4 and v5p.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe

MAX_CHIPS = 1 << 14  # chips of one slice (the largest, a v5p-17920, has 8,960)
INSTALL_HINT = "install the TPU compiler with: pip install 'upcycler[tpu]' (or pip install -e '.[tpu]')"

# generation -> (libtpu's name, cores per chip, dims of its torus/mesh)
GENERATIONS: dict[str, tuple[str, int, int]] = {
    "v4": ("v4", 2, 3),
    "v5e": ("v5e", 1, 2),
    "v5p": ("v5p", 2, 3),
    "v6e": ("v6e", 1, 2),
}
# libtpu asks for these on a host without a TPU; set, it stays quiet (values describe no real machine)
_QUIET_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_SKIP_MDS_QUERY": "1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # no chip to guard: several compiling processes may share libtpu
}


@dataclass(frozen=True)
class Slice:
    """A TPU slice: its generation, chip count and libtpu topology (e.g. v5e, 256, "16x16")."""

    generation: str
    chips: int
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        cores = GENERATIONS[self.generation][1]
        return f"{self.generation}-{self.chips * cores}"

    @property
    def libtpu_name(self) -> str:
        return f"{GENERATIONS[self.generation][0]}:{'x'.join(map(str, self.shape))}"


def parse_slice(name: str, option: str = "--topology") -> Slice:
    """`v5e-256` or `v5e:16x16` as a `Slice`; raises `UpcyclerError` naming `option` (the flag it was given
    as) and the accepted forms, or the limit of `MAX_CHIPS` chips (no slice is larger; a bigger number
    would only make libtpu build it)."""
    text = name.strip().lower().replace("litepod", "e")  # Cloud TPU's accelerator type: v5litepod-16
    if m := re.fullmatch(r"(v\d{1,3}[a-z]?):(\d{1,6}(?:x\d{1,6}){0,3})", text):
        generation, shape = m.group(1), tuple(int(s) for s in m.group(2).split("x"))
        if generation in GENERATIONS and len(shape) == GENERATIONS[generation][2] and min(shape) > 0:
            return Slice(generation, _at_most(name, _prod(shape), option), shape)
    elif m := re.fullmatch(r"(v\d{1,3}[a-z]?)-(\d{1,9})", text):
        generation, count = m.group(1), int(m.group(2))
        if generation in GENERATIONS and count > 0:
            _at_most(name, count // GENERATIONS[generation][1], option)
            cores = GENERATIONS[generation][1]
            if count % cores == 0:
                shape = _grid(count // cores, GENERATIONS[generation][2])
                if shape is not None:
                    return Slice(generation, count // cores, shape)
    known = ", ".join(GENERATIONS)
    raise UpcyclerError(
        f"{option} {describe(name)}: not a TPU slice; write GENERATION-COUNT (v5e-256, v5p-128, v6e-256) or "
        f"libtpu's GENERATION:AxB[xC] (v5e:16x16), with a generation among {known} and a power-of-two count "
        f"of at most {MAX_CHIPS:,} chips"
    )


def _at_most(name: str, chips: int, option: str) -> int:
    if chips > MAX_CHIPS:
        raise UpcyclerError(f"{option} {describe(name)}: {chips:,} chips is more than the limit of "
                            f"{MAX_CHIPS:,} chips of one slice; name a real slice size, e.g. v5e-256 or v5p-128")
    return chips


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _grid(chips: int, dims: int) -> tuple[int, ...] | None:
    """The chip grid Cloud TPU builds for `chips` (a power of two): sides as equal as possible, the
    larger last (v5e-32 is 4x8; v5p-128 is 4x4x4; a single-host v5p-8 is 2x2x1)."""
    if chips & (chips - 1):
        return None
    sides = [1] * dims
    if dims == 3 and chips >= 4:  # a v4/v5p host holds a 2x2x1 block
        sides = [2, 2, 1]
        chips //= 4
    while chips > 1:
        smallest = min(range(dims), key=lambda k: (sides[k], -k))
        sides[smallest] *= 2
        chips //= 2
    return tuple(sorted(sides)) if dims == 2 else tuple(sides)


# the scoped VMEM (KiB) the product gives every Pallas kernel and XLA fusion on a generation, through
# libtpu's `--xla_tpu_scoped_vmem_limit_kib`: libtpu's default (16 MiB on v5e and v5p, 32 on v6e) splits the
# grouped matmuls' contraction into re-read tiles; 64 MiB lets every kernel of the reference MoE take its
# whole contraction (one MoE layer 36.4 -> 30.6 GB of HBM traffic). v4's cores hold only 16 MiB.
KERNEL_VMEM_KIB = {"v5e": 64 << 10, "v5p": 64 << 10, "v6e": 64 << 10}
KERNEL_VMEM_FLAG = "--xla_tpu_scoped_vmem_limit_kib"


def libtpu_defaults() -> None:
    """Set libtpu's settings before JAX starts its backends (values already set, the user's, are kept).

    - On a host with no TPU attached: the settings libtpu would otherwise warn about on stderr at every
      JAX start (a host with chips is left alone there: libtpu must find them itself).
    - Everywhere: the kernels' scoped VMEM (`KERNEL_VMEM_KIB`) in `LIBTPU_INIT_ARGS`, for the attached
      chips' generation (Cloud TPU's `TPU_ACCELERATOR_TYPE`), or on a host without chips for the ahead-of-time
      compiles (the generations that take a larger limit all take the same one; on v4 the tiles keep to its
      16 MiB, `gmm_megablox.scoped_vmem`). A `LIBTPU_INIT_ARGS` that already sets the limit wins, so
      `--xla_tpu_scoped_vmem_limit_kib=16384` restores libtpu's default on v5e.
    """
    attached = bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))
    if not attached:
        for key, value in _QUIET_ENV.items():
            os.environ.setdefault(key, value)
    args = os.environ.get("LIBTPU_INIT_ARGS", "")
    if KERNEL_VMEM_FLAG in args:
        return
    if attached:
        try:
            kib = KERNEL_VMEM_KIB.get(parse_slice(os.environ.get("TPU_ACCELERATOR_TYPE", "")).generation)
        except UpcyclerError:  # an accelerator type this table does not know: libtpu's default
            kib = None
    else:
        kib = max(KERNEL_VMEM_KIB.values())
    if kib is not None:
        os.environ["LIBTPU_INIT_ARGS"] = f"{args} {KERNEL_VMEM_FLAG}={kib}".strip()


def tpu_devices(slice_: Slice, slices: int = 1) -> list[Any]:
    """The devices of `slices` copies of the slice joined by the data-center network (multislice), as
    libtpu describes them (no chip needed; each device has its `slice_index`); `UpcyclerError` without
    libtpu."""
    try:
        import libtpu  # noqa: F401  (only to tell a missing install from a bad topology)
    except ImportError:
        raise UpcyclerError(f"--topology {slice_.name}: libtpu is not installed; {INSTALL_HINT}") from None
    libtpu_defaults()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=slice_.libtpu_name,
            chip_config_name="default",
            chips_per_host_bounds=(min(2, slice_.shape[0]), min(2, slice_.shape[1]), 1),
            num_slices=slices,
        )
    except (RuntimeError, ValueError) as err:  # XlaRuntimeError is a RuntimeError, with a long message
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UpcyclerError(
            f"--topology {slice_.name}: libtpu cannot describe {slice_.libtpu_name} ({first[:200]}); "
            "pick another slice size"
        ) from None
    return list(topo.devices)
