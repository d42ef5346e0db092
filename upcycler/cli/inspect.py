"""`upcycle inspect PATH`: family, sizes, experts, dtype, exact total and active parameters, bytes."""

from __future__ import annotations

import json
from pathlib import Path

import click

from upcycler.summary import describe_path, format_summary


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
def command(path: Path, as_json: bool) -> None:
    """Describe the checkpoint at PATH (HF or Orbax directory; a config-only HF directory works too)."""
    info = describe_path(path)
    click.echo(json.dumps(info, indent=2) if as_json else format_summary(info))
