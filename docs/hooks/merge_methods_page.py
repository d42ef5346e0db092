"""The merge method reference, written from the merge registry (`upcycler.merge.METHODS`).

For every method: its summary and docstring, what it takes (inputs, `--base`, `--weights`, `--seed`),
how its memory grows, its paper, and a table of its own options (flag, type, default and help, read from
the method's keyword-only parameters, the same `Option`s `upcycle merge` makes its flags from). For the
averaging methods that choose their own weights, the weights they give 8 checkpoints, computed by the
method itself with its default options.
"""

from __future__ import annotations

import inspect

from config_page import default_text, type_text
from markup import code, literal, paragraphs, table

from upcycler.merge import METHODS, Method

INTRO = """# Merge method reference

Generated from the merge registry each time this site is built: every method of
`upcycle merge PATHS… OUT --method NAME`, what it takes and its own options. The options every method
shares (`--base`, `--weights`, `--seed`, `--last`/`--every`/`--until`, `--dry-run` and the output
options) are in the [command reference](commands.md#upcycle-merge); the [merging guide](../guide/merging.md)
says when to use which. Inputs are ordered oldest first, as given; a run directory expands to its steps
in step order. Every input, and the base, must have the same architecture and tensor shapes.
"""

SAMPLE = 8  # checkpoints in the weight tables of the averaging methods


def render() -> str:
    """The whole page: a summary table of the methods, then one section per method."""
    rows = [(f"[{code(m.name)}](#{m.name})", kind_text(m), inputs_text(m), "required" if m.needs_base else "",
             weights_text(m), ", ".join(code(a.flag) for a in m.args)) for m in METHODS.values()]
    lines = [INTRO, *table(("method", "kind", "inputs", "--base", "--weights", "options"), rows)]
    for method in METHODS.values():
        lines += method_section(method)
    return "\n".join(lines)


def method_section(m: Method) -> list[str]:
    """One method's heading, docstring, what it takes, options table and (averages) weights."""
    doc = inspect.getdoc(m.fn) or m.summary
    lines = [f"## `{m.name}`", "", *paragraphs(doc)]
    lines += [f"- Kind: {kind_text(m)}.", f"- Inputs: {inputs_text(m)}.", f"- Base: {base_text(m)}.",
              f"- Weights: {weights_long(m)}."]
    if m.seeded:
        lines.append("- Random: the drops are drawn per tensor (per expert) from `--seed`; the same seed gives "
                     "the same merge.")
    lines += [f"- Memory: {memory_text(m)}.", f"- Paper: <{m.paper}>", ""]
    if m.args:
        rows = [(code(a.flag), type_text(a), default_text(a), literal(a.help)) for a in m.args]
        lines += table(("option", "type", "default", "meaning"), rows)
    else:
        lines += ["No options of its own.", ""]
    if m.kind == "average" and m.weights == "none":
        lines += weights_table(m)
    return lines


def weights_table(m: Method) -> list[str]:
    """The weights the method gives `SAMPLE` checkpoints, and the share of each update between two of
    them that the average keeps (the sum of the weights from that checkpoint on)."""
    options = {a.name: a.default for a in m.args}
    w = [float(x) for x in m.fn(SAMPLE, **options)]
    kept = [sum(w[k:]) for k in range(1, SAMPLE)]
    shown = f" ({', '.join(code(f'{a.flag} {a.default:g}') for a in m.args)})" if m.args else ""
    head = ("checkpoint, oldest first", *(str(k + 1) for k in range(SAMPLE)))
    rows = [("weight", *(f"{x:.3f}" for x in w)),
            ("share kept of the update since the previous checkpoint", "", *(f"{x:.3f}" for x in kept))]
    about = (f"Weights of {SAMPLE} checkpoints{shown}. The average is the oldest checkpoint plus each update "
             "between two consecutive checkpoints times the sum of the weights from the newer one on: the "
             "second row.")
    return [about, "", *table(head, rows)]


def kind_text(m: Method) -> str:
    return "weighted average" if m.kind == "average" else "tensor by tensor"


def inputs_text(m: Method) -> str:
    if m.max_inputs == m.min_inputs:
        return f"exactly {m.min_inputs}"
    if m.max_inputs is None:
        return f"{m.min_inputs} or more"
    return f"{m.min_inputs} to {m.max_inputs}"


def base_text(m: Method) -> str:
    if m.needs_base:
        return "`--base` required: each input's task vector is the input minus the base"
    return "none (`--base` is refused)"


def weights_text(m: Method) -> str:
    if m.weights == "none":
        return "computed" if m.kind == "average" else ""
    return {"required": "required", "optional": "optional scales"}[m.weights]


def weights_long(m: Method) -> str:
    if m.weights == "required":
        return "`--weights` required, one per input, summing to 1 (`--no-normalize`: applied as given)"
    if m.weights == "optional":
        return "`--weights` optional, one scale per input (default 1 each)"
    if m.kind == "average":
        return "computed by the method (`--weights` is refused)"
    return "none (`--weights` is refused)"


def memory_text(m: Method) -> str:
    if m.streams:
        return "a fixed number of fp32 copies of one tensor, whatever the number of inputs"
    return "one fp32 copy of the tensor per input"
