"""`upcycle convert SRC DST --to hf|orbax`: re-shard, change format, family or dtype, streaming.

`--weights ema` writes the moving average a training step kept (`optimizer.ema`) instead of its weights.
A conversion that keeps every weight's bits (no `--dtype`, or one at least as wide in the same format
family) is checked against SRC on a probe before DST is renamed into place (`--no-verify` skips it).
"""

from __future__ import annotations

from pathlib import Path

import click

from upcycler.cli.options import (
    echo_verification,
    function_check,
    output_options,
    verify_option,
    write_output,
)
from upcycler.cli.path_type import OUTPUT, SOURCE
from upcycler.io import read_checkpoint
from upcycler.io.manifest import convert_step
from upcycler.tensors import dtype_name, parse_dtype


@click.command("convert")
@click.argument("src", type=SOURCE)
@click.argument("dst", type=OUTPUT)
@output_options
@verify_option
@click.option("--weights", type=click.Choice(["params", "ema"]), default="params", show_default=True,
              help="Which weights of a training step (RUN_DIR/<step>) to write: its parameters, or the moving "
                   "average kept with optimizer.ema.")
def command(src: Path, dst: Path, no_verify: bool, weights: str, **options) -> None:
    """Convert the checkpoint at SRC (HF or Orbax) into DST, one tensor in memory at a time."""
    from upcycler.transforms.pipeline import narrower

    ckpt = read_checkpoint(src, weights)
    step = convert_step(options["to"], options["family"] or ckpt.spec.family, options["dtype"])
    ckpt = ckpt.with_step(step, ckpt.spec, ckpt.tensors)
    source_dtype = ckpt.tensors["embed"].dtype
    rounds = options["dtype"] and narrower(parse_dtype(options["dtype"]), source_dtype)
    skipped = ("--no-verify" if no_verify else
               f"--dtype {options['dtype']} rounds the {dtype_name(source_dtype)} weights" if rounds else "")
    check = None if skipped else function_check(src, "convert", weights)
    out = write_output(ckpt, dst, check=check, **options)
    echo_verification(out, skipped)
    click.echo(f"wrote {out}")
