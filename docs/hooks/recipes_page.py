"""The recipe reference: the recipe format (`upcycler.transforms.recipe`) and every transform's keys.

The format is the recipe module's own documented example; each transform's keys are the fields of its
config dataclass (`upcycler.transforms.TRANSFORMS`), the same list its command's flags are made from.
"""

from __future__ import annotations

import inspect
import textwrap

from config_page import default_text, type_text
from markup import code, literal, table

from upcycler.transforms import TRANSFORMS, recipe

INTRO = """# Recipe reference

Generated from the code each time this site is built. A recipe is a YAML file that `upcycle run`
applies in one streaming pass (see [Recipes](../guide/recipes.md)):
"""


def render() -> str:
    """The whole page: the recipe format, then one table of keys per transform."""
    lines = [INTRO, "```yaml", recipe_example(), "```", ""]
    lines += ["Each transform takes the options of its command as keys, written with `_` or `-`:", ""]
    for name in sorted(TRANSFORMS):
        lines += transform_section(name)
    return "\n".join(lines)


def recipe_example() -> str:
    """The indented example of the recipe module's docstring."""
    doc = inspect.getdoc(recipe) or ""
    block = [line for line in doc.splitlines() if line.startswith("    ")]
    return textwrap.dedent("\n".join(block))


def transform_section(name: str) -> list[str]:
    """One transform's heading, summary and table of keys (with the flag each key also is)."""
    t = TRANSFORMS[name]
    rows = [(code(o.key or o.name), code(o.flag), type_text(o), default_text(o), literal(o.help))
            for o in t.options()]
    summary = f"{literal(t.summary)} The same options as [`upcycle {name}`](commands.md#upcycle-{name})."
    return [f"## `{name}`", "", summary, "", *table(("key", "flag", "type", "default", "meaning"), rows)]
