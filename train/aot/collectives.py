"""The collective traffic of one step, read from a compiled program's optimised HLO (`compiled.as_text()`).

Every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute is found wherever it sits:
in the entry computation, in a while body, in a fusion or any other called computation. Each counts as
often as it runs: the product of the trip counts of the loops around it. XLA's CPU backend prints a loop's
count (`backend_config={..."known_trip_count":{"n":"5"}}`); the TPU backend does not, so the count is
read from the loop itself: the condition compares a counter in the loop state with a constant
(`compare(get-tuple-element(p), index=0), constant(5)), direction=LT`), the counter starts from a
constant in the while's operand tuple and the body adds a constant to it. A loop whose count cannot be
read is counted once and, if it runs a collective, named in `unknown_loops`.

An asynchronous pair (`all-gather-start` … `all-gather-done`) counts once, with the done op's shape (the
result); an op wrapped by `async-start` counts once, inside the computation it calls. A collective the TPU
compiler overlaps with compute (`async-collective-start`, continuation fusions calling
`async_collective_fusion.N`, `async-collective-done`, each holding a copy of it) counts once, in the start.

The group size n of an op comes from `replica_groups`, in any of the forms XLA prints: explicit lists
`{{0,1},{2,3}}`, iota lists `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)` (groups × size), or mesh axes
`mesh['x'=2,'y'=4] {'y'}`, possibly with `, device_ids=(...)` before the braces (the product of the
named axes' sizes, a sub-axis `'y':(1)2` counting its own size). Empty groups mean every device of the
program, and so does a form this module cannot read (the largest group: traffic is not understated).

Per op, `bytes` is the full payload of one execution on one device, and `traffic_bytes` what one device
receives over the interconnect, for ring algorithms:

- all-gather: bytes = the result; traffic = bytes·(n−1)/n
- reduce-scatter: bytes = the operand (result × n); traffic = bytes·(n−1)/n
- all-reduce: bytes = the buffer; traffic = 2·bytes·(n−1)/n (a reduce-scatter then an all-gather)
- all-to-all: bytes = the buffer; traffic = bytes·(n−1)/n
- ragged-all-to-all (counted as all-to-all; newer TPU compilers, libtpu with JAX 0.12, print it as an
  asynchronous pair `ragged-all-to-all-start` … `-done`): bytes = the smaller of the rows it may send (its
  operand) and the rows it may receive (its output buffer), traffic = bytes·(n−1)/n. Which rows travel is
  decided at run time; the buffers of a dropless layer are sized for the worst case, the smaller one is
  what a device moves when routing is balanced.
- collective-permute: bytes = the buffer; traffic = bytes (0 when every device sends to itself)

The module text is read as either printer writes it (`parse_module`): an element of a tuple-shaped value
as a `get-tuple-element(%x), index=k` instruction (`compiled.as_text()` of JAX 0.10 and 0.12) or as a
compact reference `%x#k` in the operand list (`%x#1#0` nested: how the compiler of JAX 0.12 prints a module
with XLA's `xla_dump_compact_gte`), read as the instruction it stands for; and an instruction printed over
several lines (a Pallas kernel's metadata, JSON with a newline after each entry) read whole, so its
backend config and cost estimate are not lost.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# opcode -> kind; a `-start` op is counted with the shape of its `-done`
_OPCODES = {
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "ragged-all-to-all-start": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
# attributes naming a called computation, and how many times per execution of the caller it runs
# (body and condition: the trip count, applied separately)
_CALL_ATTRS = ("calls", "to_apply", "true_computation", "false_computation")
_NOT_CALLING = ("async-update", "async-done")  # they print the `calls=` of their async-start again
# The TPU compiler runs a collective it overlaps with compute as a fusion named `async-collective-start`,
# continuation fusions calling `async_collective_fusion.N` computations, and `async-collective-done`:
# each of the three holds a copy of the whole collective (same channel_id). Only the start's counts.
_ASYNC_COLLECTIVE_DONE = "async-collective-done"
_ASYNC_COLLECTIVE_CONTINUATION = "async_collective_fusion"


@dataclass(frozen=True)
class KindTraffic:
    """One kind of collective in one step, per device: how many ops the program has, how many times they
    run in all, the payload and the interconnect traffic summed over those executions."""

    ops: int = 0
    executions: int = 0
    bytes: int = 0
    traffic_bytes: float = 0.0
    dcn_traffic_bytes: float = 0.0  # the part of `traffic_bytes` of ops whose groups span slices


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction: its kind, group size, payload and traffic of one execution (per device),
    and how many times a step runs it. A collective-permute has no groups: its `group_size` is 2 when some
    device sends to another, 1 when every device sends to itself."""

    name: str
    kind: str
    computation: str
    group_size: int
    bytes: int
    traffic_bytes: float
    executions: int
    dcn: bool = False  # a transfer between slices, over the data-center network


@dataclass(frozen=True)
class CollectiveTraffic:
    """Collective traffic of one step per device, by kind (every kind of `KINDS` present), with the ops it
    sums and the loops whose trip count was unknown (each counted as running once)."""

    kinds: dict[str, KindTraffic]
    ops: tuple[CollectiveOp, ...] = ()
    unknown_loops: tuple[str, ...] = ()

    @property
    def traffic_bytes(self) -> float:
        """Interconnect bytes one device receives in a step, all kinds together."""
        return sum(k.traffic_bytes for k in self.kinds.values())

    @property
    def dcn_traffic_bytes(self) -> float:
        """The part of `traffic_bytes` carried by ops that cross slices (data-center network)."""
        return sum(k.dcn_traffic_bytes for k in self.kinds.values())


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str  # structural attributes (metadata and backend_config cut off)
    backend_config: str
    op_name: str
    frame: int = 0  # the metadata's stack_frame_id (0: none): `hlo_sources` turns it into file and line


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    root: str | None = None


def collective_traffic(hlo_text: str) -> CollectiveTraffic:
    """The collectives of the HLO module `hlo_text` and their traffic per device for one execution of the
    entry computation, loops unrolled by their trip counts (see the module docstring for the model),
    transfers between slices (`dcn`) included."""
    computations, entry = parse_module(hlo_text)
    devices = _module_devices(hlo_text)
    counts, unknown = execution_counts(computations, entry)
    ops: list[CollectiveOp] = []
    for comp_name, runs in counts.items():
        comp = computations[comp_name]
        for instr in comp.instrs.values():
            if runs == 0:
                continue
            kind = _OPCODES.get(instr.opcode)
            if kind is not None:
                ops.append(_collective_op(instr, kind, comp, devices, runs))
            elif instr.opcode == "send" and (transfer := _quoted_attr(instr.attrs, _MEGASCALE_TYPE)):
                ops.append(_dcn_op(instr, transfer, comp, runs))
    kinds = {}
    for kind in KINDS:
        mine = [op for op in ops if op.kind == kind]
        kinds[kind] = KindTraffic(
            ops=len(mine),
            executions=sum(op.executions for op in mine),
            bytes=sum(op.bytes * op.executions for op in mine),
            traffic_bytes=sum(op.traffic_bytes * op.executions for op in mine),
            dcn_traffic_bytes=sum(op.traffic_bytes * op.executions for op in mine if op.dcn),
        )
    return CollectiveTraffic(kinds=kinds, ops=tuple(ops), unknown_loops=tuple(unknown))


# ---------------------------------------------------------------------------------------------------------
# group sizes and shapes


def group_size(attrs: str, devices: int | None = None) -> int | None:
    """The number of devices in each replica group of an instruction with attributes `attrs`; `devices`
    (the program's device count) for empty or missing groups; None when it cannot be told."""
    m = re.search(r"replica_groups=", attrs)
    if m is None:
        return devices
    text = attrs[m.end():]
    if text.startswith("{"):
        body = _balanced(text, "{", "}")
        groups = re.findall(r"\{([^{}]*)\}", body[1:-1])
        if not groups:
            return devices
        return len([x for x in groups[0].split(",") if x.strip()])
    if iota := re.match(r"\[(\d+),(\d+)\]<=\[", text):
        return int(iota.group(2))
    if text.startswith("mesh["):
        mesh = _balanced(text[4:], "[", "]")
        sizes = {name: int(size) for name, size in re.findall(r"'?([\w.\-]+)'?=(\d+)", mesh)}
        rest = text[4 + len(mesh):]
        if rest.startswith(", device_ids="):  # the mesh's device order, which leaves group sizes alone
            rest = rest[len(", device_ids="):]
            rest = rest[len(_balanced(rest, "(", ")")):]
        axes = re.match(r" ?\{([^}]*)\}", rest)
        if axes is None:
            return None
        n = 1
        for ref in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", axes.group(1)):
            name, _, sub = ref
            if sub:
                n *= int(sub)
            elif name in sizes:
                n *= sizes[name]
            else:
                return None
        return n
    return None


_DTYPE_BITS = {"pred": 8, "token": 0, "opaque": 0}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `bf16[4,128]{1,0:T(8,128)(2,1)}` or a tuple `(f32[2], s32[])`, tuple
    elements summed; dynamic dimensions `<=8` count at their bound."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([^\]]*)\]", shape):
        bits = _DTYPE_BITS.get(dtype)
        if bits is None:
            digits = re.match(r"[a-z]+(\d+)", dtype)
            if digits is None:
                continue
            bits = int(digits.group(1))
        elements = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            if d:
                elements *= int(d)
        total += math.ceil(elements * bits / 8)
    return total


def _collective_op(
    instr: Instr, kind: str, comp: Computation, devices: int | None, runs: int
) -> CollectiveOp:
    """`instr` as a `CollectiveOp` run `runs` times; payload and traffic as the module docstring says."""
    shape = instr.shape
    if instr.opcode.endswith("-start"):
        done = next(
            (i for i in comp.instrs.values() if i.opcode.endswith("-done") and instr.name in i.operands), None
        )
        shape = done.shape if done is not None else _start_result(instr)
    size = shape_bytes(shape)
    if instr.opcode.startswith("ragged-all-to-all") and instr.operands:
        sent = comp.instrs.get(instr.operands[0])
        if sent is not None:
            size = min(size, shape_bytes(sent.shape))
    if kind == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", _attr(instr.attrs, "source_target_pairs") or "")
        moves = any(a != b for a, b in pairs) or not pairs
        n = 2 if moves else 1
        return CollectiveOp(instr.name, kind, comp.name, n, size, float(size if moves else 0), runs)
    n = group_size(instr.attrs, devices) or devices or 1  # groups it cannot read: the whole program
    if kind == "reduce-scatter":
        size *= n
    share = (n - 1) / n
    traffic = size * share * (2 if kind == "all-reduce" else 1)
    return CollectiveOp(instr.name, kind, comp.name, n, size, traffic, runs)


_MEGASCALE_TYPE = "_xla_megascale_transfer_type"
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
                    "ALL_TO_ALL": "all-to-all"}


def _dcn_op(instr: Instr, transfer: str, comp: Computation, runs: int) -> CollectiveOp:
    """A transfer between slices: on a multislice TPU the compiler compiles one slice's program and carries
    each collective across slices as a host-transfer `send` (with its `recv`) to the megascale runtime,
    tagged with the transfer type and the participating slices (`_xla_megascale_target="{1,2}x{0:7}"`:
    slices 1 and 2, devices 0 to 7 of each). The payload is the sent buffer; the traffic follows the ring
    formulas of the module docstring over the n slices of the group (another type: the payload, once)."""
    kind = _MEGASCALE_KINDS.get(transfer, "collective-permute")
    size = shape_bytes(_split_top(instr.shape[1:-1])[0] if instr.shape.startswith("(") else instr.shape)
    group = re.match(r"\{([^}]*)\}", _quoted_attr(instr.attrs, "_xla_megascale_target") or "")
    n = max(2, len([x for x in group.group(1).split(",") if x.strip()])) if group else 2
    if kind == "reduce-scatter":
        size *= n
    share = (n - 1) / n if kind != "collective-permute" else 1.0
    traffic = size * share * (2 if kind == "all-reduce" else 1)
    return CollectiveOp(instr.name, kind, comp.name, n, size, traffic, runs, dcn=True)


def _start_result(instr: Instr) -> str:
    """The result part of a `-start` op's shape when its `-done` is not found: all-reduce-start returns
    the result itself, all-gather-start (operands, results), collective-permute-start (operand, result,
    contexts…), ragged-all-to-all-start ((operands), result, contexts…)."""
    if not instr.shape.startswith("(") or instr.opcode == "all-reduce-start":
        return instr.shape
    parts = _split_top(instr.shape[1:-1])
    if instr.opcode in ("collective-permute-start", "ragged-all-to-all-start"):
        return parts[1] if len(parts) > 1 else parts[0]
    return "(" + ", ".join(parts[len(parts) // 2:]) + ")"


def _module_devices(hlo_text: str) -> int | None:
    """Devices of the program (partitions × replicas in the module header); None when not printed."""
    header = hlo_text.split("\n", 1)[0]
    partitions = re.search(r"num_partitions=(\d+)", header)
    replicas = re.search(r"replica_count=(\d+)", header)
    if partitions is None and replicas is None:
        return None
    return (int(partitions.group(1)) if partitions else 1) * (int(replicas.group(1)) if replicas else 1)


# ---------------------------------------------------------------------------------------------------------
# how many times each computation runs


def execution_counts(
    computations: dict[str, Computation], entry: str, *, one_branch: bool = False, continuations: bool = False
) -> tuple[dict[str, int | Fraction], list[str]]:
    """Runs of every computation reachable from `entry` in one execution of it; the loops whose trip count
    is unknown (counted once) and that run a collective, the only ones whose count matters here.

    A conditional runs one of its n branches. By default each branch is counted as running (what may run:
    a collective in any branch is seen); with `one_branch` each runs 1/n of the time, so what the branches
    move is charged as their mean: exactly one branch's when they move the same bytes, as the kernels the
    model chooses among at run time do (splash's per window and per chunk place).

    The computations of an overlapped collective's continuation fusions (`async_collective_fusion.N`) are
    left out by default: each holds a copy of the collective, counted in its start. With `continuations`
    they run as often as their fusion: beside that copy they hold the compute the collective overlaps."""
    edges: dict[str, list[tuple[str, int | Fraction]]] = {name: [] for name in computations}
    unknown: list[tuple[str, str, str]] = []  # (computation holding the loop, the loop, its body)
    for comp in computations.values():
        for instr in comp.instrs.values():
            if instr.opcode == "while":
                trips = trip_count(instr, comp, computations)
                if trips is None:
                    label = f"{instr.name} ({instr.op_name})" if instr.op_name else instr.name
                    unknown.append((comp.name, label, _attr_name(instr.attrs, "body") or ""))
                    trips = 1
                for attr in ("body", "condition"):
                    if (callee := _attr_name(instr.attrs, attr)) in computations:
                        edges[comp.name].append((callee, trips + (attr == "condition")))
            if instr.opcode in _NOT_CALLING or instr.name.startswith(_ASYNC_COLLECTIVE_DONE):
                continue
            called = [c for c in callees(instr.attrs)
                      if c in computations and (continuations or not c.startswith(_ASYNC_COLLECTIVE_CONTINUATION))]
            share = Fraction(1, len(called)) if one_branch and instr.opcode == "conditional" and called else 1
            edges[comp.name] += [(callee, share) for callee in called]
    order = _topological(edges, entry)
    counts = dict.fromkeys(order, 0)
    counts[entry] = 1
    for name in order:
        for callee, factor in edges[name]:
            counts[callee] += counts[name] * factor
    communicates: dict[str, bool] = {}
    for name in reversed(order):  # callees first
        comp = computations[name]
        communicates[name] = any(i.opcode in _OPCODES for i in comp.instrs.values()) or any(
            communicates.get(callee, False) for callee, _ in edges[name]
        )
    return counts, [label for owner, label, body in unknown if counts.get(owner) and communicates.get(body)]


def _topological(edges: dict[str, list[tuple[str, int]]], entry: str) -> list[str]:
    """Computations reachable from `entry`, every caller before its callees."""
    seen: set[str] = set()
    post: list[str] = []
    stack: list[tuple[str, int]] = [(entry, 0)]
    seen.add(entry)
    while stack:
        name, i = stack.pop()
        if i < len(edges[name]):
            stack.append((name, i + 1))
            callee = edges[name][i][0]
            if callee not in seen:
                seen.add(callee)
                stack.append((callee, 0))
        else:
            post.append(name)
    return post[::-1]


def trip_count(loop: Instr, comp: Computation, computations: dict[str, Computation]) -> int | None:
    """How many times the while `loop` (in `comp`) runs its body: XLA's `known_trip_count` when printed,
    else read from a counter that starts at a constant, moves by a constant step in the body and is
    compared with a constant in the condition; None when neither is there."""
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.backend_config):
        return int(m.group(1))
    cond = computations.get(_attr_name(loop.attrs, "condition") or "")
    body = computations.get(_attr_name(loop.attrs, "body") or "")
    if cond is None or body is None or cond.root is None or body.root is None or len(loop.operands) != 1:
        return None
    compare = cond.instrs[cond.root]
    direction = re.search(r"direction=(\w+)", compare.attrs)
    if compare.opcode != "compare" or direction is None or len(compare.operands) != 2:
        return None
    op = direction.group(1)
    left, right = (_resolve(cond, o) for o in compare.operands)
    index = _tuple_index(left)
    if index is None:
        left, right = right, left
        op = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(op, op)
        index = _tuple_index(left)
    if index is None:
        return None
    bound = _constant(right)
    if bound is None and (bound_index := _tuple_index(right)) is not None:
        bound = _init_value(loop, comp, bound_index) if _passed_through(body, bound_index) else None
    start = _init_value(loop, comp, index)
    step = _step(body, index)
    if bound is None or start is None or not step:
        return None
    return _iterations(start, bound, step, op)


def _iterations(start: int, bound: int, step: int, op: str) -> int | None:
    """Iterations of `for (i = start; i OP bound; i += step)`; None for a loop that never ends."""
    if op in ("LT", "LE") and step > 0:
        span = bound - start + (1 if op == "LE" else 0)
    elif op in ("GT", "GE") and step < 0:
        span = start - bound + (1 if op == "GE" else 0)
        step = -step
    elif op == "NE" and (bound - start) % step == 0 and (bound - start) // step >= 0:
        return (bound - start) // step
    else:
        return None
    return max(0, -(-span // step))


def _resolve(comp: Computation, name: str) -> Instr | None:
    """The instruction `name` in `comp`, looking through copies, bitcasts and converts."""
    instr = comp.instrs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands:
        instr = comp.instrs.get(instr.operands[0])
    return instr


def _tuple_index(instr: Instr | None) -> int | None:
    """k when `instr` is `get-tuple-element(...), index=k`, else None."""
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    m = re.search(r"index=(\d+)", instr.attrs)
    return int(m.group(1)) if m else None


def _constant(instr: Instr | None) -> int | None:
    """The value of a scalar integer constant, else None."""
    if instr is None or instr.opcode != "constant" or "[]" not in instr.shape.split("{")[0]:
        return None
    m = re.fullmatch(r"\s*(-?\d+)\s*", instr.operands[0] if instr.operands else "")
    return int(m.group(1)) if m else None


def _init_value(loop: Instr, comp: Computation, index: int) -> int | None:
    """The constant element `index` of the tuple the while `loop` starts from, else None."""
    init = _resolve(comp, loop.operands[0])
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    return _constant(_resolve(comp, init.operands[index]))


def _step(body: Computation, index: int) -> int | None:
    """The constant the loop body adds to (or subtracts from) element `index` of the state, else None."""
    root = body.instrs[body.root] if body.root else None
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    update = _resolve(body, root.operands[index])
    if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    a, b = (_resolve(body, o) for o in update.operands)
    if _tuple_index(a) == index and (c := _constant(b)) is not None:
        return c if update.opcode == "add" else -c
    if update.opcode == "add" and _tuple_index(b) == index and (c := _constant(a)) is not None:
        return c
    return None


def _passed_through(body: Computation, index: int) -> bool:
    """Whether the loop body returns element `index` of its state unchanged."""
    root = body.instrs[body.root] if body.root else None
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return False
    return _tuple_index(_resolve(body, root.operands[index])) == index


# ---------------------------------------------------------------------------------------------------------
# HLO text


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ELEMENT = re.compile(r"^(.+)#(\d+)$")  # a compact tuple-element reference, `while.3#1` (`%` already cut)
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')  # a double-quoted string, escaped characters in it included


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """Computations of an HLO module's text by name, and the entry's name; an instruction printed over
    several lines read whole, compact tuple-element references read as get-tuple-element instructions."""
    computations: dict[str, Computation] = {}
    entry = None
    current: Computation | None = None
    lines = text.splitlines()
    at = 0
    while at < len(lines):
        line, at = lines[at], at + 1
        if current is None:
            if header := _HEADER.match(line):
                current = Computation(header.group(2))
                computations[current.name] = current
                if header.group(1):
                    entry = current.name
            continue
        if line.rstrip() == "}":  # the computation ends
            current = None
            continue
        if m := _INSTR.match(line):
            rest, at = _whole_instruction(m.group(3), lines, at)
            instr = _parse_instr(m.group(2), rest)
            if instr is not None:
                _add(current, instr, root=bool(m.group(1)))
    if entry is None:
        raise ValueError("not an HLO module: no ENTRY computation")
    return computations, entry


def _whole_instruction(rest: str, lines: list[str], at: int) -> tuple[str, int]:
    """The text of an instruction whose first line ends with `rest`, with the lines it goes on over (a
    Pallas kernel's metadata is printed as JSON with a newline after each entry: `kernel_metadata={`, the
    entries, `}}, metadata=…`), joined; and the index of the line after it. A line goes on an instruction
    while a bracket or a quoted string of it is open; the next instruction or the computation's closing
    brace ends it in any case."""
    while at < len(lines) and not (_INSTR.match(lines[at]) or lines[at].rstrip() == "}") and _unclosed(rest):
        rest, at = rest + lines[at], at + 1
    return rest, at


def _unclosed(text: str) -> bool:
    """Whether `text` leaves a bracket or a quoted string open (brackets in quoted strings aside)."""
    bare = _QUOTED.sub("", text)
    return '"' in bare or sum(map(bare.count, "([{")) > sum(map(bare.count, ")]}"))


def _add(comp: Computation, instr: Instr, *, root: bool) -> None:
    """`instr` into `comp`, after the get-tuple-element instructions its compact operands stand for."""
    for operand in instr.operands:
        _tuple_element(comp, operand)
    comp.instrs[instr.name] = instr
    if root:
        comp.root = instr.name


def _tuple_element(comp: Computation, name: str) -> None:
    """For a compact reference `x#k` (element k of the tuple `x`; `x#1#0` nests), the get-tuple-element
    instruction it stands for, named `x#k` (no instruction's name has a `#`), with the element's shape;
    what reads the module then sees what the long printer prints: `get-tuple-element(x), index=k`."""
    element = _ELEMENT.match(name)
    if element is None or name in comp.instrs:
        return
    whole, index = element.group(1), int(element.group(2))
    _tuple_element(comp, whole)
    tuple_shape = comp.instrs[whole].shape if whole in comp.instrs else ""
    parts = _split_top(tuple_shape[1:-1]) if tuple_shape.startswith("(") else []
    shape = parts[index] if index < len(parts) else ""
    comp.instrs[name] = Instr(name, shape, "get-tuple-element", [whole], f", index={index}", "", "")


def _parse_instr(name: str, rest: str) -> Instr | None:
    """The instruction `name = rest` split into shape, opcode, operand names and attributes; None for a
    line that is not an instruction."""
    if rest.startswith("("):
        shape = _balanced(rest, "(", ")")
    else:
        shape = rest.split(" ", 1)[0]
    rest = rest[len(shape):].lstrip()
    m = re.match(r"([\w\-]+)\(", rest)
    if m is None:
        return None
    operand_text = _balanced(rest[m.end() - 1:], "(", ")")
    attrs = rest[m.end() - 1 + len(operand_text):]
    backend = ""
    if (cut := attrs.find(", backend_config=")) >= 0:
        attrs, backend = attrs[:cut], attrs[cut:]
    op_name, frame = "", 0
    if (cut := attrs.find(", metadata={")) >= 0:
        meta = re.search(r'op_name="([^"]*)"', attrs[cut:])
        op_name = meta.group(1) if meta else ""
        frame_id = re.search(r"stack_frame_id=(\d+)", attrs[cut:])
        frame = int(frame_id.group(1)) if frame_id else 0
        attrs = attrs[:cut]
    operands = [o.strip().lstrip("%") for o in _split_top(operand_text[1:-1])]
    operands = [o.split(" ")[-1].lstrip("%") for o in operands if o]  # `f32[] %x` in long form
    return Instr(name, shape, m.group(1), operands, attrs, backend, op_name, frame)


def _balanced(text: str, open_: str, close: str) -> str:
    """The prefix of `text` (which starts with `open_`) up to its matching `close`, quoted strings (with
    their escaped quotes) skipped."""
    depth = 0
    for i, ch in enumerate(_QUOTED.sub(lambda q: " " * len(q.group(0)), text)):
        if ch == open_:
            depth += 1
        elif ch == close:
            depth -= 1
            if depth == 0:
                return text[: i + 1]
    return text


def _split_top(text: str) -> list[str]:
    """`text` split at commas outside brackets, braces, parentheses and comments."""
    parts, depth, start = [], 0, 0
    text = re.sub(r"/\*.*?\*/", "", text)
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _attr(attrs: str, key: str) -> str | None:
    """The raw value of attribute `key` (a bracketed value whole), else None."""
    m = re.search(rf"\b{key}=", attrs)
    if m is None:
        return None
    value = attrs[m.end():]
    if value[:1] in "{[(":
        return _balanced(value, value[0], {"{": "}", "[": "]", "(": ")"}[value[0]])
    return re.match(r"[^,\s]*", value).group(0)


def _quoted_attr(attrs: str, key: str) -> str | None:
    """The text of a quoted attribute `key="…"` (frontend attributes), else None."""
    m = re.search(rf'\b{key}="([^"]*)"', attrs)
    return m.group(1) if m else None


def _attr_name(attrs: str, key: str) -> str | None:
    """The computation named by attribute `key`, without its `%`."""
    value = _attr(attrs, key)
    return value.lstrip("%") if value else None


def callees(attrs: str) -> list[str]:
    """Computations an instruction calls once per execution (fusions, calls, async ops, branches)."""
    names = []
    for key in (*_CALL_ATTRS, "branch_computations"):
        value = _attr(attrs, key)
        if value:
            names += [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
    return names
