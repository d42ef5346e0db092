"""The import graph keeps the architecture's direction: no cycles, and no layer reaching up.

Every module of the package (`upcycler/`, plus `train/` and `transforms/` installed as
`upcycler.train` and `upcycler.transforms`) is parsed with `ast`; every import counts, also the ones
inside functions. The layers, lowest first:

    core        spec, layout, tensors, errors, untrusted, units, schema
    adapters    families, io
    operations  transforms, merge, summary, hub, model_card
    trainer     train, verify (runs checkpoints through the JAX model)
    app         cli (imports everything; nothing imports it)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"upcycler": ROOT / "upcycler", "upcycler.train": ROOT / "train",
            "upcycler.transforms": ROOT / "transforms"}
LAYERS = [
    ("core", ("upcycler.spec", "upcycler.layout", "upcycler.tensors", "upcycler.errors", "upcycler.untrusted",
              "upcycler.units", "upcycler.schema")),
    ("adapters", ("upcycler.families", "upcycler.io")),
    ("operations", ("upcycler.transforms", "upcycler.merge", "upcycler.summary", "upcycler.hub",
                    "upcycler.model_card")),
    ("trainer", ("upcycler.train", "upcycler.verify")),
    ("app", ("upcycler.cli", "upcycler.__main__")),
]


def modules() -> dict[str, Path]:
    """Every module name of the package and its file."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[0] in ("train", "transforms") and package == "upcycler":
                continue  # not part of the upcycler folder's own tree
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that `name` imports (function-local imports included)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    edges = {name: imports(name, path, known) for name, path in found.items()}
    for name, targets in edges.items():  # `from pkg import sub` also names pkg: keep the most specific target
        edges[name] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return edges


def layer(module: str) -> int:
    if module == "upcycler":  # the package's own face re-exports core types
        return 0
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer; add it to LAYERS in {Path(__file__).name}")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_whole_package():
    edges = graph()
    assert {"upcycler.spec", "upcycler.io", "upcycler.train.trainer", "upcycler.transforms.pipeline",
            "upcycler.cli"} <= set(edges)
    assert "upcycler.io.checkpoint" in edges["upcycler.io.hf_read"]


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_module_outside_the_cli_imports_the_cli():
    offenders = sorted(m for m, targets in graph().items() if layer(m) < layer("upcycler.cli")
                       and any(t == "upcycler.cli" or t.startswith("upcycler.cli.") for t in targets))
    assert offenders == []


def test_no_layer_imports_a_higher_one():
    upward = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets if layer(t) > layer(m))
    assert upward == []


def test_io_is_one_way():
    """Inside io/: the facade on top, the format readers/writers in the middle, the shared pieces under."""
    rank = {"upcycler.io": 2, "upcycler.io.hf_read": 1, "upcycler.io.hf_write": 1, "upcycler.io.orbax_read": 1,
            "upcycler.io.orbax_write": 1}
    allowed = {("upcycler.io.hf_write", "upcycler.io.hf_read")}  # the writer names files as the reader expects

    def wrong(m: str, t: str) -> bool:
        return rank.get(t, 0) > rank.get(m, 0) or (rank.get(t, 0) == rank.get(m, 0) == 1 and (m, t) not in allowed)

    upward = sorted(f"{m} -> {t}" for m, targets in graph().items() if m.startswith("upcycler.io")
                    for t in targets if t.startswith("upcycler.io") and wrong(m, t))
    assert upward == []
