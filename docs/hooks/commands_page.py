"""The command reference, written from the `upcycle` click group itself.

For every command: its help text, its usage line, and a table of its arguments and options (the flags,
type, default and help text that `upcycle COMMAND --help` prints), then its epilog as click prints it.
"""

from __future__ import annotations

from pathlib import Path

import click
from markup import code, literal, paragraphs, table

INTRO = """# Command reference

Generated from the command line itself each time this site is built: every command of `upcycle`, its
usage, and every argument and option with its type, default and help, as `upcycle COMMAND --help`
prints them. Every command also takes `-h`/`--help`; `upcycle --version` prints the version.

The options of `continued-pretrain` whose help ends in a config key, such as `(model.remat)`, override
that key of the `--config` file; left out, the file's value (or the key's default) holds. Every key is in
the [configuration reference](configuration.md).
"""

# what a path argument or option may name, by its role (`upcycler/cli/path_type.py`)
_PATH_ROLES = {"local": "local path", "source": "path, gs:// URL or Hub model", "output": "path or gs:// URL",
               "in place": "path or gs:// URL"}


def render(group: click.Group) -> str:
    """The whole page for `group` (the `upcycle` entry point)."""
    root = click.Context(group, info_name="upcycle")
    lines = [INTRO]
    for name in group.list_commands(root):
        lines += command_section(group.get_command(root, name), root)
    return "\n".join(lines)


def command_section(command: click.Command, parent: click.Context) -> list[str]:
    """One command's heading, help, usage and parameter table, then its epilog as click prints it."""
    ctx = click.Context(command, info_name=command.name, parent=parent)
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    lines = [f"## `{ctx.command_path}`", "", *paragraphs(command.help or ""), "```text", usage, "```", ""]
    rows = [parameter_row(p) for p in command.params if not getattr(p, "hidden", False)]
    lines += table(("argument or option", "type", "default", "help"), rows)
    if command.epilog:
        lines += ["```text", command.epilog.replace("\b", "").strip("\n"), "```", ""]
    return lines


def parameter_row(param: click.Parameter) -> tuple[str, str, str, str]:
    """(flags, type, default, help) of one argument or option, from click's own description of it."""
    info = param.to_info_dict()
    if info["param_type_name"] == "argument":
        return code(param.human_readable_name), type_text(param), "required" if info["required"] else "", ""
    flags = " / ".join(code(f) for f in [*info["opts"], *info["secondary_opts"]])
    return flags, type_text(param), default_text(info), literal(info["help"] or "")


def type_text(param: click.Parameter) -> str:
    """What the parameter takes: a flag, one of its choices, a number in a range, a kind of path…"""
    info = param.to_info_dict()
    kind = info["type"]
    if info.get("is_flag"):
        text = "flag"
    elif "choices" in kind:
        text = " \\| ".join(code(str(c)) for c in kind["choices"])
    elif "min" in kind:
        low = "" if kind["min"] is None else f"{kind['min']} {'<' if kind['min_open'] else '≤'} "
        high = "" if kind["max"] is None else f" {'<' if kind['max_open'] else '≤'} {kind['max']}"
        text = f"{kind['name'].split()[0]}: {low}x{high}"
    elif getattr(param.type, "role", None) in _PATH_ROLES:
        text = _PATH_ROLES[param.type.role]
    else:
        text = kind["name"]
    if info["multiple"]:
        text += ", repeatable"
    if info["nargs"] == -1:
        text += ", one or more"
    return text


def default_text(info: dict) -> str:
    """The default as the command line takes it: "required", or blank when there is none (or a flag is off)."""
    value = info["default"]
    if info["required"]:
        return "required"
    if value is None or value is False or value == () or callable(value):
        return ""
    if info.get("is_flag"):
        return "on"
    return code(value.as_posix() if isinstance(value, Path) else str(value))
