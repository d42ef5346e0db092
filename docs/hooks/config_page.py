"""The configuration reference, written from the training config's dataclasses (`upcycler.train.config`).

Every key of a `continued-pretrain` config, dotted by section (`model.remat`, `optimizer.schedule[].kind`:
`[]` marks the entries of a list), with its type, allowed values, default and help, all read from the
fields' declarations through `upcycler.schema.options`, the same list the YAML reader and the command's
flags are made from.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path

from markup import code, literal, paragraphs, table

from upcycler.locations import Location
from upcycler.schema import Option, options, to_plain
from upcycler.train.config import TrainConfig

INTRO = """# Configuration reference

Generated from the training config's dataclasses each time this site is built: every key of the YAML
file `upcycle continued-pretrain --config` reads, dotted by section, with its type, default and meaning.
`[]` marks the entries of a list (`optimizer.schedule[].kind` is the `kind` of each schedule phase). Any
key can also be set with `--set key=value`, and most have a flag of their own (see the
[command reference](commands.md#upcycle-continued-pretrain)). A section marked optional is off when
absent; a key marked required has no default.
"""


def render(root: type = TrainConfig) -> str:
    """The whole page: one table of the top-level keys, then one table per section."""
    lines = [INTRO, *section(root, "", "Top-level keys", "")]
    for key, opt in sections(root):
        lines += section(item_type(opt), key, f"`{key}` {{ #{anchor(key)} }}", about(opt))
    return "\n".join(lines)


def sections(cls: type, prefix: str = "") -> Iterator[tuple[str, Option]]:
    """(dotted key, option) of every nested section of `cls`, depth first, in declaration order."""
    for opt in options(cls):
        if dataclasses.is_dataclass(item_type(opt)):
            key = dotted(prefix, opt)
            yield key, opt
            yield from sections(item_type(opt), key)


def section(cls: type, prefix: str, title: str, text: str) -> list[str]:
    """One section's heading, its description and the table of its keys (a subsection: a link to it)."""
    rows = []
    for opt in options(cls):
        key = dotted(prefix, opt)
        if dataclasses.is_dataclass(item_type(opt)):
            kind = f"[section](#{anchor(key)})" + (", optional" if opt.optional else "")
            rows.append((code(key), kind, "", literal(about(opt))))
        else:
            rows.append((code(key), type_text(opt), default_text(opt), literal(opt.help)))
    return [f"## {title}", "", *paragraphs(text), *table(("key", "type", "default", "meaning"), rows)]


def about(opt: Option) -> str:
    """What a section is for: its key's help, else its class's own docstring (not dataclasses' signature)."""
    cls = item_type(opt)
    doc = inspect.getdoc(cls) or ""
    return opt.help or ("" if doc.startswith(cls.__name__ + "(") else doc)


def dotted(prefix: str, opt: Option) -> str:
    """The dotted key of `opt` under `prefix`; a list of sections adds `[]`."""
    key = f"{prefix}.{opt.key or opt.name}" if prefix else opt.key or opt.name
    return f"{key}[]" if typing.get_origin(opt.type) is tuple and dataclasses.is_dataclass(item_type(opt)) else key


def anchor(key: str) -> str:
    """The id of the section heading of `key` (`optimizer.schedule[]` -> optimizer-schedule)."""
    return key.replace("[]", "").replace(".", "-")


def item_type(opt: Option) -> type:
    """The option's type, or for a list the type of its entries."""
    return typing.get_args(opt.type)[0] if typing.get_origin(opt.type) is tuple else opt.type


def type_text(opt: Option) -> str:
    """The type as a reader of YAML sees it, with its choices or range; `or null` when null is a value."""
    text = " \\| ".join(code(str(c)) for c in opt.choices) if opt.choices else _type_name(opt.type)
    if opt.range is not None:
        text += f" in {code(str(opt.range))}"
    return text + (" or null" if opt.optional else "")


def _type_name(hint: object) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin in (dict, Mapping):
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    return {Location: "path or gs:// URL", Path: "path", str: "text"}.get(hint, getattr(hint, "__name__", str(hint)))


def default_text(opt: Option) -> str:
    """The default as YAML would write it; "required" for a key without one."""
    if opt.required:
        return "required"
    return code(_yaml(to_plain(opt.default)))


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)
