"""`upcycle continued-pretrain --config train.yaml`: train a checkpoint on, with flags overriding the file.

The config and every file it names are checked (`upcycler.train.config.load_config`, then
`upcycler.train.preflight.prepare`) before the trainer, and with it JAX, is imported, so a bad config,
flag, checkpoint or data directory fails in about a second.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("continued-pretrain")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Training config (YAML); see upcycler.train.config for the schema.",
)
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in run_dir.")
@click.option("--run-dir", default=None, help="Override run_dir.")
@click.option("--steps", type=int, default=None, help="Override steps (train until this absolute step).")
@click.option("--init", default=None, help="Override model.init (the checkpoint to start from).")
@click.option("--tokenizer", default=None, help="Override model.tokenizer.")
@click.option(
    "--peak-flops", type=float, default=None, help="Per-device peak FLOP/s for MFU (metrics.peak_flops)."
)
@click.option(
    "--coordinator", default=None, help="host:port of process 0 (or auto) to run on several processes."
)
@click.option(
    "--num-processes", type=int, default=None, help="How many processes (distributed.num_processes)."
)
@click.option("--process-id", type=int, default=None, help="This process's id (distributed.process_id).")
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any config key, e.g. --set optimizer.lr=1e-4 (value parsed as YAML); repeatable.",
)
def command(
    config_path: Path,
    resume: bool,
    run_dir: str | None,
    steps: int | None,
    init: str | None,
    tokenizer: str | None,
    peak_flops: float | None,
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    sets: tuple[str, ...],
) -> None:
    """Continue pretraining a dense or upcycled MoE checkpoint on prepared data; checkpoints go to run_dir."""
    from upcycler.train.config import load_config

    overrides = {
        "run_dir": run_dir,
        "steps": steps,
        "model.init": init,
        "model.tokenizer": tokenizer,
        "metrics.peak_flops": peak_flops,
        "distributed.coordinator": coordinator,
        "distributed.num_processes": num_processes,
        "distributed.process_id": process_id,
    }
    config = load_config(config_path, overrides, sets)
    from upcycler.train.preflight import prepare

    checked = prepare(config, resume)
    from upcycler.train.trainer import train

    result = train(config, resume=resume, checked=checked)
    how = "stopped by SIGTERM" if result.preempted else "finished"
    click.echo(f"{how} at step {result.step}; last checkpoint: {result.last_checkpoint}")
