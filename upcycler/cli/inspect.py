"""`upcycle inspect PATH`: family, sizes, experts, dtype, exact total and active parameters, bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from upcycler.cli.path_type import SOURCE
from upcycler.io import detect_format, read_checkpoint
from upcycler.io.hf_read import read_spec, weight_files_present
from upcycler.summary import checkpoint_summary, format_summary, spec_summary


def describe_path(path: Path) -> dict[str, Any]:
    """Summary of a checkpoint directory; a config-only HF directory gives the architecture alone."""
    if detect_format(path) == "hf" and not weight_files_present(path):
        return {"path": str(path), **spec_summary(read_spec(path)), "weights": "none (config only)"}
    return checkpoint_summary(read_checkpoint(path))


@click.command("inspect")
@click.argument("path", type=SOURCE)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
def command(path: Path, as_json: bool) -> None:
    """Describe the checkpoint at PATH (HF or Orbax directory; a config-only HF directory works too)."""
    info = describe_path(path)
    click.echo(json.dumps(info, indent=2) if as_json else format_summary(info))
