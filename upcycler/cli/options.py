"""Output options shared by every command that writes a checkpoint (convert, transforms, merge)."""

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
    """Apply --dtype, then write `ckpt` to `out` as requested by `output_options`."""
    if dtype:
        ckpt = ckpt.replace(tensors=ckpt.tensors.astype(parse_dtype(dtype)))
    options: dict[str, Any] = {"overwrite": overwrite, **extra}
    if to == "hf":
        options.update(family=family, shard_size=parse_size(shard_size, "--shard-size"))
    elif family:
        raise click.BadParameter("--family applies to --to hf only")
    return write_checkpoint(ckpt, out, to=to, **options)
