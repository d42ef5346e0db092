"""`upcycle report RUN_DIR`: PNG plots of a training run (loss curves, expert load per layer)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to write the PNGs [default: RUN_DIR/report].",
)
def command(run_dir: Path, out: Path | None) -> None:
    """Plot RUN_DIR/metrics.jsonl of a continued-pretrain run into PNG files."""
    from upcycler.train.report import make_report

    for path in make_report(run_dir, out):
        click.echo(str(path))
