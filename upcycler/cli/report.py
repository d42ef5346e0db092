"""`upcycle report RUN_DIR`: PNG plots of a training run (loss curves, expert load per layer, expert usage
by data source, expert health)."""

from __future__ import annotations

from pathlib import Path

import click

from upcycler.cli.path_type import BUCKET_OR_LOCAL, LOCAL_PATH


@click.command("report")
@click.argument("run_dir", type=BUCKET_OR_LOCAL)
@click.option(
    "--out",
    type=LOCAL_PATH,
    default=None,
    help="Where to write the PNGs [default: RUN_DIR/report; needed when RUN_DIR is gs://].",
)
def command(run_dir: Path | str, out: Path | None) -> None:
    """Plot RUN_DIR/metrics.jsonl of a continued-pretrain run into PNG files: losses, expert load per MoE
    layer, which data source goes to which expert, expert health.

    A torn last line (a run killed mid-write) is ignored; any other malformed line is an error naming
    it. The PNGs appear in --out only once all of them are drawn.
    """
    from upcycler.locations import location
    from upcycler.train.reporting.plots import make_report
    from upcycler.untrusted import shown_path

    for path in make_report(location(run_dir, "RUN_DIR"), out):
        click.echo(shown_path(path))
