"""The HLO readers (`collectives`, `hbm_traffic`) on both printers of JAX's TPU compiler, read from
fixtures: small programs compiled for a TPU v5e-4 slice by JAX 0.10 and 0.12 (`tests/data/hlo`, written
by `make_fixtures.py` under each JAX, with XLA's own figures in `figures.json`), so no compiler is needed.

Three texts per program: `.jax010.hlo` and `.jax012.hlo`, what `compiled.as_text()` prints under each JAX
(tuple elements as get-tuple-element instructions), and `.jax012.compact.hlo`, the same 0.12 executable as
its compiler prints it with compact tuple elements (`%while#1`). A Pallas kernel with metadata is printed
over three lines by both. The figures must agree between the texts of one executable exactly, between the
two JAX versions where the program is the same, and with XLA's where XLA counts the same thing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from upcycler.train.aot.collectives import Computation, Instr, collective_traffic, parse_module, trip_count
from upcycler.train.aot.hbm_traffic import charges, hbm_bytes, matmul_flops

DATA = Path(__file__).parent / "data" / "hlo"
FIGURES = json.loads((DATA / "figures.json").read_text())
FORMS = ("jax010", "jax012", "jax012.compact")
COMPACT_REFERENCE = re.compile(r"%[\w.\-]+#\d")  # `%while#1`: element 1 of the tuple `%while`
# the programs as make_fixtures.py compiles them
ROWS, WIDTH, LAYERS, SHARDS = 128, 256, 3, 4
STACK_ROWS, STACK_WIDTH = 512, 2048  # the bf16 layer stack (`layers_scan`, `layers_unrolled`)
LAYER_WEIGHT_BYTES = 2 * STACK_WIDTH * STACK_WIDTH * 2  # the two bf16 weights of one layer
LAYER_FLOPS = 2 * (2 * STACK_ROWS * STACK_WIDTH * STACK_WIDTH)  # the two matmuls of one layer
KERNEL_BYTES = 123_456  # the kernel's own estimate; its operand and result are 4 KiB each
FSDP_LAYER_FLOPS = 2 * (2 * (ROWS // SHARDS) * WIDTH * WIDTH)  # per device: its rows through two weights


def hlo(program: str, form: str) -> str:
    return (DATA / f"{program}.{form}.hlo").read_text()


def xla(program: str, form: str) -> dict[str, float]:
    """XLA's `cost_analysis()` of the executable the text `form` of `program` prints."""
    return FIGURES[form.split(".")[0]]["programs"][program]


def the_loop(text: str) -> tuple[Instr, Computation, dict[str, Computation]]:
    computations, _ = parse_module(text)
    loops = [(i, c) for c in computations.values() for i in c.instrs.values() if i.opcode == "while"]
    assert len(loops) == 1
    return *loops[0], computations


def canonical(comp: Computation, name: str) -> str:
    """An operand as the printer-independent `tuple#index` when it is an element of a tuple, else its name."""
    instr = comp.instrs[name]  # every operand is an instruction of its computation
    if instr.opcode != "get-tuple-element":
        return name
    index = re.search(r"index=(\d+)", instr.attrs).group(1)
    return f"{canonical(comp, instr.operands[0])}#{index}"


def instructions(text: str) -> dict[tuple[str, str], tuple]:
    """Every instruction but the tuple elements, by (computation, name): opcode, shape, operands (elements
    as `tuple#index`), whether it has a backend config, and a kernel's cost estimate."""
    computations, _ = parse_module(text)
    return {(comp.name, instr.name): (instr.opcode, instr.shape, operands(comp, instr), bool(instr.backend_config),
                                      "cost_estimate" in instr.backend_config)
            for comp in computations.values() for instr in comp.instrs.values()
            if instr.opcode != "get-tuple-element"}


def operands(comp: Computation, instr: Instr) -> list[str]:
    if instr.opcode in ("parameter", "constant"):  # a number or a literal, not instructions
        return instr.operands
    return [canonical(comp, o) for o in instr.operands]


@pytest.mark.parametrize("program", ["layers_scan", "layers_unrolled", "sort_pairs", "kernel", "collectives",
                                     "fsdp_scan"])
def test_both_printers_of_one_executable_read_the_same(program):
    """The 0.12 executable's two texts parse to the same instructions with the same operands, every tuple
    element resolved to the tuple and index a get-tuple-element names, and every figure is the same."""
    plain, compact = hlo(program, "jax012"), hlo(program, "jax012.compact")
    assert not COMPACT_REFERENCE.search(plain)
    assert bool(COMPACT_REFERENCE.search(compact)) == (program in ("layers_scan", "sort_pairs", "fsdp_scan"))
    assert instructions(compact) == instructions(plain)
    assert hbm_bytes(compact) == hbm_bytes(plain)
    assert matmul_flops(compact) == matmul_flops(plain)
    assert collective_traffic(compact) == collective_traffic(plain)


def test_compact_references_nest_and_keep_their_shapes():
    module = """HloModule m

ENTRY %main (p0: (f32[10], (f32[20], s32[])), p1: f32[20]) -> f32[20] {
  %p0 = (f32[10]{0}, (f32[20]{0}, s32[])) parameter(0)
  %p1 = f32[20]{0} parameter(1)
  ROOT %root = f32[20]{0} add(f32[20]{0} %p0#1#0, %p1)
}
"""
    computations, entry = parse_module(module)
    main = computations[entry]
    inner, outer = main.instrs["p0#1#0"], main.instrs["p0#1"]
    assert (inner.opcode, inner.operands, inner.attrs, inner.shape) == ("get-tuple-element", ["p0#1"], ", index=0",
                                                                         "f32[20]{0}")
    assert (outer.operands, outer.attrs, outer.shape) == (["p0"], ", index=1", "(f32[20]{0}, s32[])")
    assert main.instrs["root"].operands == ["p0#1#0", "p1"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("program", ["layers_scan", "fsdp_scan"])
def test_a_layer_loop_runs_its_trip_count(program, form):
    """The scan's trip count is read whatever the printer (read raw, the compact text's loop ran once)."""
    text = hlo(program, form)
    loop, comp, computations = the_loop(text)
    assert trip_count(loop, comp, computations) == LAYERS
    assert collective_traffic(text).unknown_loops == ()


@pytest.mark.parametrize("form", FORMS)
def test_the_loop_body_is_charged_once_per_layer(form):
    """Each run of the body reads its own layer's weights from HBM (the compiler of JAX 0.10 also writes
    half of them back, a copy in another layout), and runs once per layer: the scan of LAYERS layers is
    charged LAYERS layers' weights and more."""
    text = hlo("layers_scan", form)
    loop, _, computations = the_loop(text)
    body = computations[loop.attrs.split("body=%")[1].split(",")[0]]
    in_body = [c for c in charges(text) if c.instr.name in body.instrs]  # names are the module's, unique
    assert {c.runs for c in in_body} == {LAYERS}
    assert LAYER_WEIGHT_BYTES <= sum(c.bytes for c in in_body) <= 2 * LAYER_WEIGHT_BYTES
    assert hbm_bytes(text) >= LAYERS * LAYER_WEIGHT_BYTES


@pytest.mark.parametrize("form", FORMS)
def test_matmul_flops_are_xlas_with_every_layer_counted(form):
    """Without a loop the matmul FLOPs are XLA's figure less its elementwise work (under 0.5%); under
    `lax.scan` they stay those of the unrolled program, where XLA counts the loop's body once."""
    unrolled, scanned = matmul_flops(hlo("layers_unrolled", form)), matmul_flops(hlo("layers_scan", form))
    assert unrolled == scanned == LAYERS * LAYER_FLOPS
    assert 0.995 * xla("layers_unrolled", form)["flops"] <= unrolled <= xla("layers_unrolled", form)["flops"]
    assert xla("layers_scan", form)["flops"] == pytest.approx(xla("layers_unrolled", form)["flops"] / LAYERS,
                                                               rel=0.02)
    gathered = matmul_flops(hlo("collectives", form))  # one matmul: each device's rows by the gathered weight
    assert 0.99 * xla("collectives", form)["flops"] <= gathered == 2 * (ROWS // SHARDS) * WIDTH * WIDTH


@pytest.mark.parametrize("form", FORMS)
def test_matmuls_an_overlapped_collective_holds_are_counted(form):
    """FSDP: the TPU compiler overlaps a weight's gather with the other weight's matmul, which then sits in
    a continuation fusion (`async_collective_fusion.N`): half of the layers' matmuls are there."""
    text = hlo("fsdp_scan", form)
    assert "calls=%async_collective_fusion" in text
    assert matmul_flops(text) == LAYERS * FSDP_LAYER_FLOPS
    assert xla("fsdp_scan", form)["flops"] == pytest.approx(FSDP_LAYER_FLOPS, rel=0.02)  # XLA: the body once


@pytest.mark.parametrize("form", FORMS)
def test_collectives_count_once_per_execution_on_every_printer(form):
    """Each FSDP weight gathered whole (bf16, as the matmul reads it) once per layer, its overlapped copies
    not counted again; the same ops and bytes from both JAX versions."""
    fsdp = collective_traffic(hlo("fsdp_scan", form)).kinds
    gathered = fsdp["all-gather"]
    assert (gathered.ops, gathered.executions, gathered.bytes) == (2, 2 * LAYERS, 2 * LAYERS * WIDTH * WIDTH * 2)
    assert gathered.traffic_bytes == gathered.bytes * (SHARDS - 1) / SHARDS
    assert fsdp == collective_traffic(hlo("fsdp_scan", "jax010")).kinds
    single = collective_traffic(hlo("collectives", form)).kinds
    assert single == collective_traffic(hlo("collectives", "jax010")).kinds
    assert single["all-gather"].bytes == WIDTH * WIDTH * 2


@pytest.mark.parametrize("form", FORMS)
def test_a_kernels_estimate_is_found_on_its_three_lines(form):
    """The kernel's metadata puts its backend config on the third line of the instruction; its estimate
    is charged, as XLA charges it (XLA also counts the 4 KiB the kernel's result is read back from VMEM)."""
    text = hlo("kernel", form)
    assert 'kernel_metadata={\n"xprof_metadata"' in text
    (kernel,) = [c for c in charges(text) if c.is_kernel]
    assert (kernel.estimate, kernel.bytes, kernel.operand_bytes) == (KERNEL_BYTES, KERNEL_BYTES, 4096)
    assert matmul_flops(text) == 2 * 8 * 128  # the kernel's own FLOP estimate
    assert 0 <= xla("kernel", form)["bytes accessed"] - hbm_bytes(text) <= 8192


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("program", ["layers_unrolled", "sort_pairs", "collectives"])
def test_a_program_without_loops_is_charged_at_most_what_xla_charges(program, form):
    """On the TPU, XLA's figure also counts the arrays in on-chip memory, which the walk leaves out: never
    more than XLA, and the same from the two texts of an executable."""
    assert 0 < hbm_bytes(hlo(program, form)) <= xla(program, form)["bytes accessed"]


@pytest.mark.parametrize("form", FORMS)
def test_a_tuple_results_elements_are_its_elements(form):
    """The sort returns a tuple; what reads its two elements reads elements 0 and 1 of the sort."""
    computations, entry = parse_module(hlo("sort_pairs", form))
    main = computations[entry]
    root = main.instrs[main.root]
    elements = [main.instrs[o] for o in root.operands]
    assert [(e.opcode, main.instrs[e.operands[0]].opcode) for e in elements] == [("get-tuple-element", "sort")] * 2
    assert sorted(e.attrs for e in elements) == [", index=0", ", index=1"]
