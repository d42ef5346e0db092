"""The HBM traffic of one step, read from a compiled program's optimised HLO with loops counted.

XLA's own figure (`compiled.cost_analysis()["bytes accessed"]`) counts a while loop's body once, so a
model whose layers run under `lax.scan` is charged one layer's traffic whatever its depth (measured: a
demo MoE step's figure stays within 4% from 2 to 9 layers). The roofline's memory term needs the traffic
the step really moves. This module walks the program the way `collectives` does, each computation run as
often as the loops around it say (`collectives.execution_counts`), and charges every instruction that
reaches memory with the bytes it reads and writes:

- a fusion (or any other instruction): its operands and its result; the computations a fusion or a
  reduction calls run on values already read, so they are not walked;
- an operand a fusion only slices (`dynamic-slice`, `slice`, `gather`): the slices, not the whole array
  (a scanned layer reads its own layer of a stacked weight), also when a fusion nested in the fusion
  takes the slice; a slice brought into on-chip memory is the slice read, nothing written;
- an asynchronous op (`async-start` calling a computation): what the computation it wraps is charged,
  once (the start's own operands and result are that computation's); in the short form `Compiled.as_text`
  prints (`slice-start`, `copy-start`, whose tuple shape holds the operand beside the result): the slice
  read (a copy: its operand) and the result written, once;
- a result written in place (`dynamic-update-slice`, alone or at a fusion's root): the update, and the
  array it updates is not read (a scanned layer writes its own layer of the stacked activations);
- an operand a fusion hands through to its result untouched (the TPU compiler's fusions that carry an
  overlapped collective's buffers): neither read nor written;
- a conditional's n branches: each 1/n of the conditional's runs, so their mean, which is one branch's when
  they move the same bytes (the kernels chosen at run time: splash's per window and per chunk place);
- nothing for what moves no data: parameters, tuples and their elements, constants, bitcasts, the loops,
  calls and branches themselves (their bodies are walked), the `-done` half of an asynchronous pair, the
  TPU's buffer reservations and the concatenations it reads off them (`AllocateBuffer`, `ConcatBitcast`);
- nothing for arrays in an on-chip memory space (`S(1)` in a TPU layout: VMEM), which are not HBM; the
  copies that bring them there are charged like any other instruction;
- a Pallas/Mosaic kernel (`tpu_custom_call`): at least what the kernel's own cost estimate says it moves
  (`cost_estimate.bytes_accessed` in its backend config), never less than its operands and result once. A
  tiled kernel re-reads its operands (megablox's grouped matmul reads the lhs once per column tile and a
  weight block once per row tile): charged its operands alone, the reference MoE's grouped matmuls looked
  five times cheaper than their own estimate. A kernel without an estimate (splash attention) is charged
  its operands and result.

`charges` lists what each instruction is charged, `breakdown` sums them by the line of our code that
traced them (`hlo_sources`), the kernels by name, so the sources of a step's traffic can be read.

The same walk counts the step's matmul FLOPs (`matmul_flops`), which XLA's `cost_analysis()["flops"]` also
counts with each loop body once: every dot and convolution (the TPU compiler's form of a matmul) as XLA
counts it, inside fusions too and inside the continuation fusions of an overlapped collective, which hold
the matmuls the collective overlaps; each kernel at its own estimate's FLOPs, except megablox's grouped
matmuls (`gmm`, `tgmm`), whose estimate counts each row once though their grid multiplies a whole row tile
once per group the tile holds: they are charged their grid (`grid_repeats`), and `grouped_matmul_waste`
says how much that adds. tokamax's (`gmm_v2`, `tgmm_v2`) are charged each group's rows rounded up to
their bucket, half a bucket per group as routed groups' sizes fall. Elementwise work is left out: on a program without loops it is XLA's figure less
that work (tested: within 0.5% on a stack of layers).

It is a model of the traffic, like XLA's, not a measurement: caches, fusion into a consumer's prologue and
rematerialisation the compiler does after scheduling are not seen. On a program without loops it agrees
with XLA's figure within a few percent on the CPU (tested); on the TPU, XLA's figure is the larger, as it
also counts the arrays in on-chip memory (tested).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from upcycler.train.aot.collectives import (
    Computation,
    Instr,
    _attr,
    _split_top,
    callees,
    execution_counts,
    parse_module,
    shape_bytes,
)

_FREE = frozenset({
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call", "conditional",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "async-done",
    "async-update", "all-gather-done", "all-reduce-done", "collective-permute-done", "copy-done",
    "send-done", "recv-done",
})
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
# asynchronous slices and copies in the printer's short form (`slice-start(%x), slice={…}`, `copy-start(%x)`),
# as `Compiled.as_text()` prints them; their `-done` halves move nothing more
_ASYNC_START = re.compile(r"^(slice|dynamic-slice|copy)-start$")
# TPU custom calls that move no data: a buffer reserved for operands written into it in place, their
# concatenation read off that buffer, an annotation on gather indices
_FREE_TARGETS = re.compile(r'custom_call_target="(AllocateBuffer|ConcatBitcast|AssumeGatherIndicesInBound)"')
_IN_PLACE = "dynamic-update-slice"
_ON_CHIP = re.compile(r"S\((?!0\))\d+\)")  # a non-default memory space in a layout
_ARRAY = re.compile(r"\b[a-z]+\d*[a-z0-9]*\[[^\]]*\](\{[^}]*\})?")


_KERNEL_TARGET = 'custom_call_target="tpu_custom_call"'
_GROUPED_MATMULS = ("gmm", "tgmm")  # megablox's kernels (`_kernel_name`): a grid step per row tile and group
_TOKAMAX_GROUPED = re.compile(r"^t?gmm_v2-g_(\d+)-m_(\d+)-")  # tokamax's, named after their shapes and tiles
_BUCKET = re.compile(r'bucket_base\\?"\s*:\s*(\d+)')
_ESTIMATE = re.compile(r'"cost_estimate"\s*:\s*(\{[^}]*\})')


@dataclass(frozen=True)
class Charge:
    """What one instruction is charged per execution (`bytes`), and how often it runs in one step.

    For a kernel, `estimate` is its own cost estimate and `operand_bytes` its operands and result once;
    `bytes` is the larger. Both are None for every other instruction."""

    instr: Instr
    runs: int | float  # a conditional's branch: 1/n of its conditional's runs (`collectives.execution_counts`)
    bytes: int
    estimate: int | None = None
    operand_bytes: int | None = None

    @property
    def total(self) -> int:
        return self.runs * self.bytes

    @property
    def is_kernel(self) -> bool:
        return self.operand_bytes is not None


def hbm_bytes(hlo_text: str) -> float:
    """Bytes one device reads from and writes to HBM in one execution of the HLO module `hlo_text`, loops
    unrolled by their trip counts (see the module docstring for what is charged)."""
    return float(sum(c.total for c in charges(hlo_text)))


def charges(hlo_text: str) -> Iterator[Charge]:
    """Every instruction of `hlo_text` that moves HBM bytes, with its charge and its runs per step."""
    computations, entry = parse_module(hlo_text)
    counts, _ = execution_counts(computations, entry, one_branch=True)
    inner = _called_on_values(computations)
    for name, runs in counts.items():
        if runs == 0 or name in inner:
            continue
        comp = computations[name]
        runs = int(runs) if runs == int(runs) else float(runs)  # a branch of a conditional: its share of the runs
        for instr in comp.instrs.values():
            charged = _instr_bytes(instr, comp, computations)
            if instr.opcode == "custom-call" and _KERNEL_TARGET in instr.attrs:
                estimate = kernel_estimate(instr)
                yield Charge(instr, runs, max(charged, estimate or 0), estimate, charged)
            elif charged:
                yield Charge(instr, runs, charged)


def kernel_estimate(instr: Instr, key: str = "bytes_accessed") -> int | None:
    """What a Pallas/Mosaic kernel's own cost estimate says one call moves (`key`: `flops` for what it
    computes); None without one."""
    found = _ESTIMATE.search(instr.backend_config) or _ESTIMATE.search(instr.attrs)
    if found is None:
        return None
    value = json.loads(found.group(1)).get(key)
    return int(value) if value is not None else None


def hbm_array_bytes(shape: str) -> int:
    """Bytes of the arrays of `shape` (an HLO shape, maybe a tuple) that live in HBM."""
    return sum(shape_bytes(m.group(0)) for m in _ARRAY.finditer(shape)
               if not (m.group(1) and _ON_CHIP.search(m.group(1))))


def _called_on_values(computations: dict[str, Computation]) -> set[str]:
    """Computations that run on values already in registers or on-chip memory: fusion bodies, reducers and
    comparators (`to_apply`), and everything they call."""
    inner: set[str] = set()
    for comp in computations.values():
        for instr in comp.instrs.values():
            if instr.opcode == "fusion":
                inner.update(callees(instr.attrs))
            elif "to_apply=" in instr.attrs:
                inner.update(c for c in callees(instr.attrs) if f"to_apply=%{c}" in instr.attrs
                             or f"to_apply={c}" in instr.attrs)
    frontier = list(inner)
    while frontier:
        comp = computations.get(frontier.pop())
        for instr in comp.instrs.values() if comp else ():
            for callee in callees(instr.attrs):
                if callee not in inner:
                    inner.add(callee)
                    frontier.append(callee)
    return inner


def _instr_bytes(instr: Instr, comp: Computation, computations: dict[str, Computation]) -> int:
    """The walker's charge of one instruction (a kernel: its operands and result once)."""
    if instr.opcode in _FREE:
        return 0
    operands = [comp.instrs.get(name) for name in instr.operands]
    if instr.opcode == "custom-call" and _FREE_TARGETS.search(instr.attrs):
        return 0
    if instr.opcode == "async-start" and callees(instr.attrs):
        return 0  # the wrapped computation (an asynchronous slice, copy …) is walked and charged itself
    if instr.opcode.endswith(("-done", "-update")) and _ASYNC_START.match(instr.opcode.rsplit("-", 1)[0] + "-start"):
        return 0
    if started := _ASYNC_START.match(instr.opcode):
        return _async_start_bytes(started.group(1), instr, operands)
    if instr.opcode in _SLICING:
        source = operands[0] if operands else None
        read = shape_bytes(instr.shape) if source is None or hbm_array_bytes(source.shape) else 0
        return read + hbm_array_bytes(instr.shape)  # read the slice, write it (nothing when on chip)
    if instr.opcode == _IN_PLACE:
        update = operands[1] if len(operands) > 1 else None
        return 2 * (hbm_array_bytes(update.shape) if update else 0)
    if instr.opcode == "fusion":
        called = [computations[c] for c in callees(instr.attrs) if c in computations]
        if called:
            return _fusion_bytes(instr, operands, called[0], computations)
    return hbm_array_bytes(instr.shape) + sum(hbm_array_bytes(o.shape) for o in operands if o is not None)


def _async_start_bytes(op: str, instr: Instr, operands: list[Instr | None]) -> int:
    """An asynchronous slice or copy in short form: what it reads (the slice; for a copy, its operand) and
    what it writes to HBM. Its shape is a tuple holding the operands as well as the result, which a plain
    charge would count twice: (operands, result, context) for a slice, (result, operand, context) for a
    copy."""
    parts = _split_top(instr.shape[1:-1]) if instr.shape.startswith("(") else [instr.shape]
    result = parts[0] if op == "copy" else (parts[1] if len(parts) > 1 else parts[0])
    source = operands[0] if operands else None
    in_hbm = source is None or hbm_array_bytes(source.shape) > 0
    read = (hbm_array_bytes(source.shape) if source is not None else 0) if op == "copy" else \
        (shape_bytes(result) if in_hbm else 0)
    return read + hbm_array_bytes(result)


def _fusion_bytes(instr: Instr, operands: list[Instr | None], body: Computation,
                  computations: dict[str, Computation]) -> int:
    """A fusion's traffic: each operand as much of it as the body reads, each result less what it updates
    in place."""
    params = _parameters(body)
    uses = _uses(body)
    root = body.instrs.get(body.root or "")
    outputs = [body.instrs.get(n) for n in root.operands] if root is not None and root.opcode == "tuple" else [root]
    results = [m.group(0) for m in _ARRAY.finditer(instr.shape)]
    written = 0
    updated: set[str] = set()  # parameters updated in place
    for output, result in zip(outputs, results, strict=False):
        if hbm_array_bytes(result) == 0 or (output is not None and output.opcode == "parameter"):
            continue  # written on chip, or an operand handed through (a collective's buffer)
        if output is not None and output.opcode == _IN_PLACE and len(output.operands) > 1:
            update = body.instrs.get(output.operands[1])
            written += shape_bytes(update.shape) if update is not None else 0
            updated.add(output.operands[0])
        else:
            written += shape_bytes(result)
    read = 0
    for name, number in params.items():
        operand = operands[number] if number < len(operands) else None
        if operand is None or hbm_array_bytes(operand.shape) == 0:
            continue
        mine = _readers(name, uses)
        if mine and all(user is root and root.opcode == "tuple" for user, _ in mine):
            continue  # handed through to the result, not read
        if name in updated and all(user.opcode == _IN_PLACE and position == 0 for user, position in mine):
            continue  # the array updated in place is not read
        read += _bytes_read(name, hbm_array_bytes(operand.shape), uses, computations)
    return read + written


def _bytes_read(name: str, whole: int, uses: dict[str, list[tuple[Instr, int]]],
                computations: dict[str, Computation]) -> int:
    """What a fusion body reads of the value `name` (`whole` bytes): the slices it takes when it only
    slices it (slices of slices: the innermost; a nested fusion: what that fusion's body reads of it),
    else all of it."""
    readers = _readers(name, uses)
    if not readers:
        return whole
    total = 0
    for user, position in readers:
        if user.opcode in _SLICING and position == 0:
            total += _bytes_read(user.name, shape_bytes(user.shape), uses, computations)
        elif user.opcode == "fusion" and (inner := _called_body(user, computations)) is not None:
            param = next((n for n, number in _parameters(inner).items() if number == position), None)
            total += whole if param is None else _bytes_read(param, whole, _uses(inner), computations)
        else:
            return whole
    return min(whole, total)


def _called_body(instr: Instr, computations: dict[str, Computation]) -> Computation | None:
    return next((computations[c] for c in callees(instr.attrs) if c in computations), None)


def _parameters(body: Computation) -> dict[str, int]:
    """A computation's parameters: name -> parameter number."""
    return {inner.name: int(inner.operands[0]) for inner in body.instrs.values()
            if inner.opcode == "parameter" and inner.operands and inner.operands[0].isdigit()}


def _uses(body: Computation) -> dict[str, list[tuple[Instr, int]]]:
    """Value name -> the instructions of `body` that take it, with the operand position."""
    uses: dict[str, list[tuple[Instr, int]]] = {}
    for inner in body.instrs.values():
        for position, operand in enumerate(inner.operands):
            uses.setdefault(operand, []).append((inner, position))
    return uses


def _readers(name: str, uses: dict[str, list[tuple[Instr, int]]]) -> list[tuple[Instr, int]]:
    """The instructions of a fusion body that read the value `name`, seen through bitcasts (which move no
    data), each with the operand position it is read at."""
    found = []
    for user, position in uses.get(name, ()):
        if user.opcode == "bitcast":
            found += _readers(user.name, uses)
        else:
            found.append((user, position))
    return found


@dataclass(frozen=True)
class Source:
    """The traffic charged to one source of a step: a line of our code (`dir/file.py:line function`), or a
    kernel (`kernel gmm`); `instructions` of it ran `executions` times in all and moved `bytes`."""

    name: str
    bytes: int
    executions: int
    instructions: int
    kernel_estimate: int = 0  # of `bytes`, what kernels were charged beyond their operands (their estimates)


def breakdown(hlo_text: str) -> list[Source]:
    """The step's traffic by source, largest first. An instruction is charged to the innermost frame of the
    stack that traced it that lies in our code (not in JAX or another library); a kernel to its name
    (megablox's `gmm`, `tgmm`; splash's kernels) and that frame."""
    from upcycler.train.aot.hlo_sources import SourceTables

    tables = SourceTables(hlo_text)
    rows: dict[str, list[int]] = {}
    for charge in charges(hlo_text):
        frame = next((f for f in tables.stack(charge.instr.frame) if _ours(f.file)), None)
        where = frame.short() if frame is not None else f"({charge.instr.opcode}, no source)"
        if charge.is_kernel:
            where = f"kernel {_kernel_name(charge.instr)} @ {where}"
        row = rows.setdefault(where, [0, 0, 0, 0])
        row[0] += charge.total
        row[1] += charge.runs
        row[2] += 1
        row[3] += charge.runs * (charge.bytes - (charge.operand_bytes or charge.bytes))
    return sorted((Source(name, *row) for name, row in rows.items()), key=lambda s: -s.bytes)


def _ours(path: str) -> bool:
    return "site-packages" not in path and "/jax/" not in path and not path.startswith("<")


def _kernel_name(instr: Instr) -> str:
    """A kernel's name: the function JAX traced it in (`…/jit(tgmm)/pallas_call` -> `tgmm`), else the
    instruction's name without XLA's numbering (`splash_mha_dq.1` -> `splash_mha_dq`)."""
    traced = re.findall(r"jit\((\w+)\)", instr.op_name.rsplit("/pallas_call", 1)[0])
    return traced[-1] if traced else re.sub(r"\.\d+$", "", instr.name)


# ---------------------------------------------------------------------------------------------------------
# matmul FLOPs


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of one device's matrix products in one execution of the HLO module `hlo_text`, loops unrolled
    by their trip counts: every `dot` and `convolution` wherever it sits (fusion bodies included, and the
    continuation fusions of an overlapped collective, which hold the compute it overlaps), each counted as
    XLA's cost analysis counts it, and each Pallas kernel's own estimate (`cost_estimate.flops`)."""
    computations, entry = parse_module(hlo_text)
    counts, _ = execution_counts(computations, entry, one_branch=True, continuations=True)
    return float(sum(runs * _matmul_flops(instr, computations[name])
                     for name, runs in counts.items() for instr in computations[name].instrs.values()))


def grouped_matmul_waste(hlo_text: str) -> float:
    """FLOPs one device's grouped-matmul kernels compute in one execution of `hlo_text` beyond what their
    own estimates say (each row once): the row tiles a group boundary crosses, multiplied once per group
    they hold (`grid_repeats`), loops unrolled by their trip counts. 0 for a program without them."""
    computations, entry = parse_module(hlo_text)
    counts, _ = execution_counts(computations, entry, one_branch=True, continuations=True)
    return float(sum(runs * (kernel_estimate(instr, "flops") or 0) * (grid_repeats(instr, computations[name]) - 1)
                     for name, runs in counts.items() for instr in computations[name].instrs.values()
                     if instr.opcode == "custom-call" and _KERNEL_TARGET in instr.attrs))


def grid_repeats(instr: Instr, comp: Computation) -> float:
    """How many times over a kernel multiplies its rows, against its estimate's once: for megablox's
    grouped matmuls (`gmm`, `tgmm`), their grid's steps over the row tiles; for tokamax's (`gmm_v2`,
    `tgmm_v2`), which start each group's tiles at its first row and round its rows up to a bucket (128 or
    256 rows, named in the kernel's metadata), the expected half bucket per group; else 1.

    Each grid step multiplies a whole row tile and keeps the rows of one group, so a tile that holds rows
    of n groups is multiplied n times. The grid has row tiles + G − 1 steps, all of which run when no
    group boundary falls on a tile's edge (the rule with routed tokens): the kernel's scalar operands say
    so, the group offsets [G + 1] and each step's group [row tiles + G − 1]."""
    tokamax = _TOKAMAX_GROUPED.match(instr.name)
    if tokamax:  # each group's rows rounded up to a bucket: half a bucket per group, on average
        groups, rows = int(tokamax[1]), int(tokamax[2])
        bucket = _BUCKET.search(instr.attrs + instr.backend_config)
        return (rows + groups * (int(bucket[1]) if bucket else 128) / 2) / rows
    if _kernel_name(instr) not in _GROUPED_MATMULS:
        return 1.0
    shapes = _operand_shapes(instr, comp)
    if len(shapes) < 3:
        return 1.0
    groups, steps = _elements(shapes[1]) - 1, _elements(shapes[2])
    row_tiles = steps - groups + 1
    return steps / row_tiles if groups > 0 and row_tiles > 0 else 1.0


def _operand_shapes(instr: Instr, comp: Computation) -> list[str]:
    """The shapes of `instr`'s operands: its `operand_layout_constraints` (a custom call's), else the
    shapes of the instructions it names."""
    constraints = _attr(instr.attrs, "operand_layout_constraints")
    if constraints:
        return _split_top(constraints[1:-1])
    return [comp.instrs[name].shape for name in instr.operands if name in comp.instrs]


def _matmul_flops(instr: Instr, comp: Computation) -> int:
    """The FLOPs of one execution of `instr` when it is a matrix product or a kernel, else 0."""
    if instr.opcode == "custom-call" and _KERNEL_TARGET in instr.attrs:
        return round((kernel_estimate(instr, "flops") or 0) * grid_repeats(instr, comp))
    operands = [comp.instrs.get(name) for name in instr.operands[:2]]
    if instr.opcode not in ("dot", "convolution") or len(operands) < 2 or any(o is None for o in operands):
        return 0
    if instr.opcode == "dot":
        contracted = [int(d) for d in re.findall(r"\d+", _attr(instr.attrs, "lhs_contracting_dims") or "")]
        lhs = _dims(operands[0].shape)
        return 2 * _elements(instr.shape) * _product(lhs[d] for d in contracted)
    return _convolution_flops(instr, _dims(operands[0].shape), _dims(operands[1].shape))


def _convolution_flops(instr: Instr, lhs: list[int], rhs: list[int]) -> int:
    """2 × the multiply-adds of a convolution (the TPU compiler's form of a matmul), as XLA counts them:
    input features (per feature group) × output features × batch (per batch group) × the (output, kernel)
    position pairs of each spatial dimension that read an input element."""
    labels = re.fullmatch(r"(\w+)_(\w+)->(\w+)", _attr(instr.attrs, "dim_labels") or "")
    if labels is None:
        return 0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out = _dims(instr.shape)
    windows = _window(_attr(instr.attrs, "window") or "")
    positions = 1
    for k, window in enumerate(windows[: sum(c.isdigit() for c in lhs_labels)]):
        d = str(k)
        positions *= _read_positions(lhs[lhs_labels.index(d)], rhs[rhs_labels.index(d)], out[out_labels.index(d)],
                                     *window)
    features = lhs[lhs_labels.index("f")] // int(_attr(instr.attrs, "feature_group_count") or 1)
    batch = lhs[lhs_labels.index("b")] // int(_attr(instr.attrs, "batch_group_count") or 1)
    return 2 * features * out[out_labels.index("f")] * batch * positions


def _window(text: str) -> list[tuple[int, int, int, int, int]]:
    """Per spatial dimension of `window={size=2x2 stride=… pad=…_…x… lhs_dilate=… rhs_dilate=…}`: stride,
    low and high padding, input (base) dilation and kernel (window) dilation."""
    fields = dict(re.findall(r"(\w+)=([-\d_x]+)", text))
    count = len(fields.get("size", "").split("x")) if "size" in fields else 0

    def per_dim(key: str, default: str) -> list[str]:
        return fields[key].split("x") if key in fields else [default] * count

    pads = [p.split("_") for p in per_dim("pad", "0_0")]
    return [(int(stride), int(low), int(high), int(base), int(dilation)) for stride, (low, high), base, dilation
            in zip(per_dim("stride", "1"), pads, per_dim("lhs_dilate", "1"), per_dim("rhs_dilate", "1"), strict=True)]


def _read_positions(size_in: int, kernel: int, size_out: int, stride: int, low: int, high: int, base: int,
                    dilation: int) -> int:
    """How many (output, kernel) position pairs of one spatial dimension read an input element rather than
    padding or a hole of the input's dilation (XLA's `GetConvolutionFlops`, its shortcuts included)."""
    if (size_in == size_out == kernel == base and dilation == 1 and stride == max(1, size_in - 1)
            and low == high == 0):
        return size_in  # a batch dimension laid out as a spatial one
    if size_in == 1 and kernel == size_out and dilation == base == stride == 1 and low == high == size_out - 1:
        return size_out
    if stride == 1 and base == 1:
        return sum(max(min(size_in + low - k * dilation, size_out) - max(low - k * dilation, 0), 0)
                   for k in range(kernel))
    total = 0
    for k in range(kernel):
        for o in range(size_out):
            index = o * stride - low + k * dilation
            total += index % base == 0 and 0 <= index // base < size_in
    return total


def _dims(shape: str) -> list[int]:
    """The dimensions of an array shape (`bf16[4,<=8]{…}`: [4, 8]; a scalar: [])."""
    m = re.search(r"\[([^\]]*)\]", shape)
    return [int(d.strip().lstrip("<=")) for d in m.group(1).split(",") if d.strip()] if m else []


def _elements(shape: str) -> int:
    return _product(_dims(shape))


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
