"""Output options shared by every command that writes a checkpoint (convert, transforms, merge), and the
`--no-verify` switch of the writes that claim to preserve the function (convert, transforms, recipes)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from upcycler.io import write_checkpoint
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.hf_write import DEFAULT_SHARD_SIZE
from upcycler.tensors import parse_dtype
from upcycler.units import parse_size


def output_options(fn: Callable) -> Callable:
    """Add --to, --family, --dtype, --shard-size and --overwrite to a click command."""
    for option in reversed([
        click.option("--to", "to", type=click.Choice(["hf", "orbax"]), default="hf", show_default=True,
                     help="Output format."),
        click.option("--family", default=None,
                     help="Target HF family (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, glm4_moe); "
                          "default: the model's own."),
        click.option("--dtype", default=None, type=click.Choice(["bf16", "fp16", "fp32"]),
                     help="Cast floating tensors (default: keep the source dtype)."),
        click.option("--shard-size", default=str(DEFAULT_SHARD_SIZE), show_default=True,
                     help="Largest HF shard, e.g. 5GB or 500MB."),
        click.option("--overwrite", is_flag=True, help="Replace OUT if it exists."),
    ]):
        fn = option(fn)
    return fn


def write_output(ckpt: Checkpoint, out: Path, *, to: str, family: str | None, dtype: str | None,
                 shard_size: str, overwrite: bool, **extra: Any) -> Path:
    """Apply --dtype (buffers stay float32), then write `ckpt` to `out` as requested by `output_options`."""
    if dtype:
        ckpt = ckpt.cast(parse_dtype(dtype))
    options: dict[str, Any] = {"overwrite": overwrite, **extra}
    if to == "hf":
        options.update(family=family, shard_size=parse_size(shard_size, "--shard-size"))
    elif family:
        raise click.BadParameter("--family applies to --to hf only")
    return write_checkpoint(ckpt, out, to=to, **options)


def verify_option(fn: Callable) -> Callable:
    """--no-verify: skip the function check a function-preserving write runs before its output is renamed."""
    return click.option("--no-verify", "no_verify", is_flag=True,
                        help="Skip checking the written model against the source on a probe (the check runs "
                             "after every function-preserving write, before the output is put in place).")(fn)


def function_check(source: Path, what: str, weights: str = "params") -> Callable[[Path], dict]:
    """The check a function-preserving write runs on its staged output: the written model against
    `source` (its `weights`) on a probe (`upcycler.verify.check_written`); `what` names the write."""
    from upcycler.verify import check_written

    return lambda staged: check_written(source, staged, what=what, weights=weights)


def echo_verification(out: Path, skipped: str) -> None:
    """Say on stderr how the written model was checked (its manifest's record), or why it was not."""
    from upcycler.io.manifest import read_manifest

    record = read_manifest(out).extra.get("verification")
    if isinstance(record, dict) and "verdict" in record:
        click.echo(f"verified: {record['verdict']}", err=True)
    elif skipped:
        click.echo(f"not verified: {skipped}", err=True)
