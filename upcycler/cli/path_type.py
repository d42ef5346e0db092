"""The type of every path argument and option of the CLI: a local path; a URL is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from upcycler.locations import local_path


class LocalPathType(click.ParamType):
    """`upcycler.locations.local_path` of the value, naming the argument or option it was given as."""

    name = "path"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        if param is None:
            what = "path"
        else:
            what = param.opts[0] if param.param_type_name == "option" else param.human_readable_name
        return local_path(value, what)


LOCAL_PATH = LocalPathType()
