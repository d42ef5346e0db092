"""The types of the CLI's path arguments and options: where each may point.

- `LOCAL_PATH`: a local path only (a URL is refused in one line naming the argument);
- `SOURCE`: a local path, a bucket URL (`gs://…`) or a Hub model (`org/name`, `hf://org/name`, with
  `@revision`), read from where it is (`upcycler.cli.remote_locations` makes the remote ones local);
- `OUTPUT`: a local path or a bucket URL, published there when the command succeeds;
- `BUCKET_OR_LOCAL`: a local path or a bucket URL that the command itself reads and writes in place
  (a training config's `run_dir`, as a flag).

Values stay text for remote locations (a `str`, checked to name a bucket) and become a `Path` otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from upcycler.io.object_store import is_bucket_url
from upcycler.locations import bucket_and_key, local_path


def option_name(param: click.Parameter | None) -> str:
    """How an error names the argument or option `param` (`--base`, `SRC`)."""
    if param is None:
        return "path"
    return param.opts[0] if param.param_type_name == "option" else param.human_readable_name


class LocationType(click.ParamType):
    """A path argument or option whose `role` is "local", "source" or "output" (see the module docstring)."""

    name = "path"

    def __init__(self, role: str):
        self.role = role

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        if isinstance(value, str) and self.role != "local" and is_bucket_url(value):
            bucket_and_key(value, option_name(param))
            return value
        if isinstance(value, str) and self.role == "source" and value.startswith("hf://"):
            return value
        return local_path(value, option_name(param))


LOCAL_PATH = LocationType("local")
SOURCE = LocationType("source")
OUTPUT = LocationType("output")
BUCKET_OR_LOCAL = LocationType("in place")
