"""The import graph keeps the architecture's direction: no cycles, and no layer reaching up.

Every module of the package (`upcycler/`, plus `train/` and `transforms/` installed as
`upcycler.train` and `upcycler.transforms`) is parsed with `ast`; every import counts, also the ones
inside functions, and so does what an import sets off: importing `a.b.c` first runs `a/__init__.py` and
`a/b/__init__.py`, so a module that imports `a.b.c` from outside `a.b` depends on the package `a.b` too
(a package's own modules have it initialised already). The layers, lowest first:

    core        spec, layout, tensors, errors, untrusted, locations, units, schema
    adapters    families, io
    operations  transforms, merge, summary, hub, model_card
    trainer     train, verify (runs checkpoints through the JAX model)
    app         cli (imports everything; nothing imports it)

Inside the trainer, its rooms (`ROOMS`), lowest first: config and data; the model; what rides on the
loop (techniques) and evaluation; reporting; the loop; aot (compiles the loop's step). A room imports
its own modules and the rooms below it, and the model imports none of the code that knows the mesh.

ARCHITECTURE.md names every module file in its layer or room, as `folder/name` or in a group
`folder/{name, name}.py` (`documented`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"upcycler": ROOT / "upcycler", "upcycler.train": ROOT / "train",
            "upcycler.transforms": ROOT / "transforms"}
LAYERS = [
    ("core", ("upcycler.spec", "upcycler.layout", "upcycler.tensors", "upcycler.errors", "upcycler.untrusted",
              "upcycler.locations", "upcycler.bucket_client", "upcycler.units", "upcycler.schema",
              "upcycler.hardware")),
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


def ancestors(module: str) -> list[str]:
    """The packages importing `module` initialises first: `a`, `a.b` for `a.b.c`."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def graph(package_init: bool = True) -> dict[str, set[str]]:
    """Module -> the modules it imports. With `package_init`, also the packages an import initialises
    that the importer's own packages have not (see the module docstring)."""
    found = modules()
    known = set(found)
    edges = {name: imports(name, path, known) for name, path in found.items()}
    for name, targets in edges.items():  # `from pkg import sub` also names pkg: keep the most specific target
        edges[name] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    if package_init:
        for name, targets in edges.items():
            own = set(ancestors(name)) | {name}
            edges[name] = targets | {p for t in targets for p in ancestors(t) if p in known and p not in own}
    return edges


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


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
    assert {"upcycler.spec", "upcycler.io", "upcycler.train.loop.trainer", "upcycler.transforms.pipeline",
            "upcycler.cli"} <= set(edges)
    assert "upcycler.io.checkpoint" in edges["upcycler.io.hf_read"]


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_a_cycle_through_a_package_initialisation_is_seen():
    """`model/__init__` imports `transformer`; were `transformer` to import a module that imports
    `model.params`, the cycle runs through the package's initialisation, not through any module's own
    import list: only the package edges see it."""
    edges = graph()
    edges["upcycler.train.model.transformer"] = edges["upcycler.train.model.transformer"] | {"upcycler.train.loop.sharding"}
    assert edges["upcycler.train.loop.sharding"] >= {"upcycler.train.model.params", "upcycler.train.model"}
    assert any({"upcycler.train.model", "upcycler.train.loop.sharding"} <= set(c) for c in cycles(edges))
    without = graph(package_init=False)
    without["upcycler.train.model.transformer"] |= {"upcycler.train.loop.sharding"}
    assert cycles(without) == []  # what the walk saw before it counted package initialisation


ROOMS = [  # (rank, room, packages): a room imports itself and the rooms of a lower rank
    (0, "configuration and data", ("upcycler.train.config", "upcycler.train.data")),
    (1, "model", ("upcycler.train.model",)),
    (2, "techniques", ("upcycler.train.techniques",)),
    (2, "evaluation", ("upcycler.train.evaluation",)),
    (3, "reporting", ("upcycler.train.reporting",)),
    (4, "loop", ("upcycler.train.loop",)),
    (5, "compile-only", ("upcycler.train.aot",)),
]
MESH_CODE = ("upcycler.train.loop.sharding", "upcycler.train.loop.mesh")


def room(module: str) -> tuple[int, str] | None:
    """(rank, name) of the trainer room `module` lives in; None outside the trainer's rooms."""
    for rank, name, prefixes in ROOMS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank, name
    return None


def test_every_trainer_module_has_a_room():
    homeless = sorted(m for m in graph() if m.startswith("upcycler.train.") and room(m) is None)
    assert homeless == []
    top_level = sorted(p.name for p in PACKAGES["upcycler.train"].glob("*.py") if p.name != "__init__.py")
    assert top_level == ["config.py"]  # every other module lives in the room of its concern


def test_trainer_rooms_import_only_their_own_and_lower_rooms():
    """Techniques and evaluation share a rank but not their modules: a technique does not evaluate, and
    evaluating a checkpoint needs no technique."""
    wrong = []
    for m, targets in graph().items():
        here = room(m)
        for t in targets:
            there = room(t)
            if here and there and there[1] != here[1] and there[0] >= here[0]:
                wrong.append(f"{m} -> {t}")
    assert sorted(wrong) == []


def test_the_model_imports_no_mesh_code():
    """The model declares logical axes and is placed from outside (`model.placement`): nothing it
    imports, directly or through another module, is the code that builds or maps the mesh."""
    edges = graph()
    offenders = sorted(f"{m} -> {sorted(reachable(edges, m) & set(MESH_CODE))}" for m in edges
                       if m.startswith("upcycler.train.model") and reachable(edges, m) & set(MESH_CODE))
    assert offenders == []


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


DOC = ROOT / "ARCHITECTURE.md"


def doc_key(path: Path) -> str:
    """How ARCHITECTURE.md names a module file: its folder's own name and its name, `reporting/metrics_log`."""
    return f"{path.parent.name}/{path.stem}"


def documented(text: str) -> tuple[set[str], set[str]]:
    """(every `folder/name` the text names, those of them named in a group `folder/{a, b}`). Written out,
    a name counts wherever it stands in a path (`train/reporting/metrics.py` names `reporting/metrics`)."""
    grouped = {f"{folder}/{name.strip()}" for folder, group in re.findall(r"(\w+)/\{([^}]*)\}", text)
               for name in group.split(",")}
    written = {f"{folder}/{name}" for folder, name in re.findall(r"(?<![\w.])(?=(\w+)/(\w+))", text)}
    return grouped | written, grouped


def test_architecture_names_every_module():
    """A module file (not a package's `__init__.py`) that ARCHITECTURE.md does not name fails, and so does
    a name in one of its groups that is no module (a module renamed or removed): the map stays whole.
    The `folder/name` form is unambiguous only while no two module files share it."""
    files = [path for path in modules().values() if path.name != "__init__.py"]
    keys = [doc_key(path) for path in files]
    assert sorted(k for k in set(keys) if keys.count(k) > 1) == []
    named, grouped = documented(DOC.read_text(encoding="utf-8"))
    missing = sorted(str(path.relative_to(ROOT)) for path in files if doc_key(path) not in named)
    assert missing == [], f"name these in {DOC.name}, in their layer or room, with what each is for"
    stale = sorted(grouped - set(keys))
    assert stale == [], f"{DOC.name} names modules that do not exist"


LENT_LOOKUPS = ("service", "providing")  # the ambient lookup transforms once read their inputs through
COLLECTOR = "transform_collected"  # the one context variable of transforms/: what a transform says


def python_files() -> list[Path]:
    """Every Python file of the package and of the folders that use it (bench, scripts, examples, tests)."""
    extra = [path for folder in ("bench", "scripts", "examples", "tests")
             for path in (ROOT / folder).rglob("*.py")]
    return sorted({*modules().values(), *extra})


def called_name(call: ast.Call) -> str | None:
    """The name a call is made through: `f` for `f(…)` and `m.f(…)`."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def ambient_lookups(source: str, *, in_transforms: bool) -> list[str]:
    """Where `source` defines, imports or calls an ambient lookup (`LENT_LOOKUPS`) and, `in_transforms`,
    makes a context variable other than the collector of what transforms say: `line: what`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = called_name(node) if isinstance(node, ast.Call) else None
        if name in LENT_LOOKUPS:
            found.append(f"{node.lineno}: calls {name}(…)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in LENT_LOOKUPS:
            found.append(f"{node.lineno}: defines {node.name}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in LENT_LOOKUPS for a in node.names):
            found.append(f"{node.lineno}: imports {', '.join(a.name for a in node.names)}")
        elif name == "ContextVar" and in_transforms:
            label = node.args[0] if isinstance(node, ast.Call) and node.args else None
            if not (isinstance(label, ast.Constant) and label.value == COLLECTOR):
                found.append(f"{node.lineno}: makes a context variable other than {COLLECTOR!r}")
    return sorted(found, key=lambda line: int(line.partition(":")[0]))


def test_transforms_get_what_they_need_as_an_argument():
    """A transform is given everything it uses beyond its config, spec and tensors in its `TransformContext`
    argument, built by `pipeline.plan` from what the command lends: no module defines, imports or calls an
    ambient lookup (`service(name)`, lent by `providing(...)`), and the only context variable under
    `transforms/` collects what a transform says (`report`, `record`, `read_input`), never what it reads."""
    transforms = PACKAGES["upcycler.transforms"]
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in python_files()
                 for line in ambient_lookups(path.read_text(encoding="utf-8"),
                                             in_transforms=path.is_relative_to(transforms))]
    assert offenders == []


def test_the_lookup_check_sees_every_form():
    source = ("from contextvars import ContextVar\n"
              "from upcycler.transforms.registry import service\n"
              "_LENT = ContextVar('transform_services', default=None)\n"
              "_SAID = ContextVar('transform_collected', default=None)\n"
              "def providing(**lent): ...\n"
              "fit = registry.service('attention_fit')\n"
              "dtype = service('output_dtype')\n")
    assert ambient_lookups(source, in_transforms=True) == [
        "2: imports service", "3: makes a context variable other than 'transform_collected'",
        "5: defines providing", "6: calls service(…)", "7: calls service(…)"]
    assert ambient_lookups(source, in_transforms=False) == [
        "2: imports service", "5: defines providing", "6: calls service(…)", "7: calls service(…)"]


TRAINER = ROOT / "train" / "loop" / "trainer.py"
LOOP_LINES = 250  # the loop is the step, the clock and the actions; techniques live beside it
LONGEST_FUNCTION = 100


def test_the_training_loop_stays_small():
    lines = len(TRAINER.read_text(encoding="utf-8").splitlines())
    assert lines < LOOP_LINES, f"{TRAINER.relative_to(ROOT)} has {lines} lines: move what is not the loop out"


def test_no_function_is_longer_than_a_screenful():
    long = sorted(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
                  for path in modules().values()
                  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION)
    assert long == []


def technique_classes() -> dict[str, type]:
    """Every class a module of train/techniques/ defines, by `module.Class`."""
    import importlib
    import inspect

    found = {}
    for name in sorted(m for m in modules() if m.startswith("upcycler.train.techniques.")):
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name:
                found[f"{name.rpartition('.')[2]}.{cls_name}"] = cls
    return found


# what train/techniques/ defines that is no technique: the protocol's own types (the checked reading of a
# checkpoint's meta among them, and the in-step half's base), the window of counts the expert technique
# keeps, and what held-out evaluation asks of the run's evaluator
NOT_TECHNIQUES = {"protocol.Technique", "protocol.StepContext", "protocol.Action", "protocol.Rewind",
                  "protocol.Checkpoints", "protocol.MetaEntries", "expert_window.ExpertWindow",
                  "in_step.StepTechnique", "heldout.Evaluator"}


def test_every_technique_implements_the_protocol():
    """A class of train/techniques/ is a technique on one protocol, the loop's half (`Technique`) or the
    step's (`StepTechnique`), or one of the protocol's own types: its hooks keep the protocol's signatures,
    and the checkpoint meta's keys it declares are its own, none of the loop's. No technique is defined
    anywhere else."""
    import importlib
    import inspect

    from upcycler.train.techniques.in_step import StepTechnique
    from upcycler.train.techniques.protocol import Technique

    classes = technique_classes()
    assert set(NOT_TECHNIQUES) <= set(classes)
    techniques = {k: c for k, c in classes.items() if k not in NOT_TECHNIQUES}
    assert sorted(k for k, c in techniques.items() if not issubclass(c, Technique | StepTechnique)) == []
    loop = {k: c for k, c in techniques.items() if issubclass(c, Technique)}
    step = {k: c for k, c in techniques.items() if issubclass(c, StepTechnique)}
    # spike guard, finiteness, expert window, checkpoint schedule, preemption, held-out evaluation, profiling
    assert len(loop) >= 7 and len(step) >= 3  # selection-bias balancing, weights average, z-loss ramp
    wrong = []
    for half, base in ((loop, Technique), (step, StepTechnique)):
        hooks = [n for n, f in vars(base).items() if inspect.isfunction(f) or isinstance(f, classmethod)]
        wrong += [f"{k}.{hook}" for k, cls in half.items() for hook in hooks
                  if list(inspect.signature(getattr(cls, hook)).parameters)
                  != list(inspect.signature(getattr(base, hook)).parameters)]
    assert wrong == []
    keys = [key for cls in loop.values() for key in cls.meta_keys]
    assert len(keys) == len(set(keys))
    assert not set(keys) & {"step", "tokens_seen", "lr", "spec", "lineage"}
    elsewhere = []
    for name in sorted(m for m in modules() if m.startswith("upcycler.train.")
                       and not m.startswith("upcycler.train.techniques.")):
        module = importlib.import_module(name)
        elsewhere += [f"{name}.{n}" for n, cls in inspect.getmembers(module, inspect.isclass)
                      if cls.__module__ == name and issubclass(cls, Technique | StepTechnique)]
    assert elsewhere == []


STEP_WIRING = ("make_train_step", "state_layout", "compile_step")  # what assembles and compiles a run's step
STEP_BUILDER = {"train/loop/run_build.py", "train/loop/train_step.py"}  # the builder, and where they are defined


def test_one_builder_assembles_the_step():
    """The trainer, compile-only, the planner and the benchmarks take their step from `run_build.build`:
    no other file calls what wires the mesh, the layout and the step together."""
    callers = []
    for path in sorted([*ROOT.glob("upcycler/**/*.py"), *ROOT.glob("train/**/*.py"), *ROOT.glob("bench/*.py")]):
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in STEP_WIRING and where not in STEP_BUILDER:
                    callers.append(f"{where}:{node.lineno} {name}")
    assert callers == []


REPORTING_LINES = 400


def test_no_reporting_module_is_over_400_lines():
    """The report's modules stay small: one purpose each (the run's figures, the expert figures, the log)."""
    long = {p.name: n for p in (ROOT / "train" / "reporting").glob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > REPORTING_LINES}
    assert long == {}


def test_no_family_name_under_transforms():
    """A transform knows families only through their fields (`upcycler.families.base.Family`): no string
    under transforms/ is a family's name, model type or architecture (docstrings aside)."""
    from upcycler.families import FAMILIES

    names = {n for f in FAMILIES.values() for n in (f.name, f.model_type, f.architecture)}
    found = []
    for path in sorted((ROOT / "transforms").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        found += [f"{path.name}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings]
    assert found == []
