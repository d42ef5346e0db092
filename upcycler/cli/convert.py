"""`upcycle convert SRC DST --to hf|orbax`: re-shard, change format, family or dtype, streaming."""

from __future__ import annotations

from pathlib import Path

import click

from upcycler.cli.options import output_options, write_output
from upcycler.io import read_checkpoint
from upcycler.io.manifest import convert_step


@click.command("convert")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@output_options
def command(src: Path, dst: Path, **options) -> None:
    """Convert the checkpoint at SRC (HF or Orbax) into DST, one tensor in memory at a time."""
    ckpt = read_checkpoint(src)
    step = convert_step(options["to"], options["family"] or ckpt.spec.family, options["dtype"])
    ckpt = ckpt.with_step(step, ckpt.spec, ckpt.tensors)
    out = write_output(ckpt, dst, **options)
    click.echo(f"wrote {out}")
